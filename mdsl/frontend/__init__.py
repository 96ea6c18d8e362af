"""The user-facing DSL: `@mdsl.kernel`, `Tensor[...]` annotations, tracing, the `mdsl.*` functions."""
