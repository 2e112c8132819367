"""`verifypd distill`: trains an EAGLE-3-style draft head for a target by self-distillation."""
