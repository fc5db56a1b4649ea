"""tether inside other trainers: `tether.integrations.trl` (TRL's GRPOTrainer). The tensor
API they are built on is `tether.api`; docs/integrations.md covers both, and verl."""
