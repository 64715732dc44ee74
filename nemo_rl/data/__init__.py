"""Prompt data: datasets, prompt templates, task processors and the data loader."""
