"""RL post-training algorithms: loss functions, advantage estimators and their configs."""
