"""Several ranks as one engine: torch.distributed groups and local spawning (group, failures),
DistConfig, the step consensus, the decision log and its checker, the rank engine (one model
part per rank, one logical cache everywhere), and speculation on ranks. Above engine/."""
