"""A model's part on one rank: tensor-parallel head shards (tp), pipeline stages (pp), the
context-parallel forward (cp) with its attention (cp_attn) and per-layer KV gather (cp_gather).
Above model/ and memory/, below engine/: the rank engine (kvstrata.ranks) places these parts."""
