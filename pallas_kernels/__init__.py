"""Pallas kernels, each beside a pure-jnp reference (see STYLE.md)."""
