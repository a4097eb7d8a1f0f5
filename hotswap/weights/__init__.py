"""Weights in: one pipeline, four stages, whatever the source. `readers.read` (one table of
readers, one row per form) -> `plan.plan` (the one validator call, spec-driven; no bytes
moved) -> `place.prepare` (a strategy row: copy, in_place, merge) -> `StagedParams`, the only
thing `engine/lifecycle.update_weights` takes. `pipeline.stage` runs the line for a copy."""
