"""Experience collection: rollouts of the policy against environments."""
