"""Training loops (target LM, drafters) on optax, with orbax checkpoints and exact resume."""
