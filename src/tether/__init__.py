"""tether: RL for LLMs that stays stable when the generator and the trainer disagree."""

__version__ = "0.1.0"
