"""What describes a model: its config, the parameter spec table, params, the forward pass, the
step inputs and the sharding rules. Imported by everything else; imports nothing of the engine."""
