"""Plug-ins by import path: what resolves, and what each wrong path or shape is told."""

from __future__ import annotations

import os.path

import pytest

from nemo_rl.utils.plugins import PluginError, check_callable, load_function, load_object


def test_load_object_follows_module_and_dotted_attribute() -> None:
    assert load_object("os.path:join", "f") is os.path.join
    assert load_object("os:path.join", "f") is os.path.join


@pytest.mark.parametrize(
    "path, needle",
    [
        ("os.path.join", "f='os.path.join' is not an import path; write 'package.module:name'"),
        (":join", "is not an import path"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("os.path:jion", "'os.path' has no attribute 'jion' (it defines: "),
    ],
)
def test_bad_paths_name_the_field_and_the_fix(path: str, needle: str) -> None:
    with pytest.raises(PluginError) as info:
        load_object(path, "f")
    assert needle in str(info.value)


def test_callable_shape_is_checked() -> None:
    def two(a, b):
        return a + b

    check_callable(two, 2, "f", "m:two", "two(a, b)")
    with pytest.raises(PluginError, match=r"f='m:two' cannot be called as g\(a, b, c\)"):
        check_callable(two, 3, "f", "m:two", "g(a, b, c)")
    with pytest.raises(PluginError, match="f='os:sep' is a str, not a function"):
        load_function("os:sep", 1, "f", "g(a)")
