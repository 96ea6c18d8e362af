"""Passes over the mugraph: abstract expressions, the subexpression check, and (later) canonicalisation,
verification, layout, memory planning, scheduling and thread-graph fusion."""
