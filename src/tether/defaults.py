"""Defaults shared by a config field and the library function it feeds: one value, one place.

Calling the library directly (`SamplingParams()`, `ensure_default_model(...)`,
`greedy_accuracy(...)`) then behaves like a run with the default config. Plain values
only: `tether.config` imports this module, and `tether config` must not load torch.
"""

MAX_NEW_TOKENS = 16
"""rollout.max_new_tokens; SamplingParams.max_new_tokens; greedy_accuracy(max_new_tokens=)."""

GROUP_SIZE = 8
"""rollout.group_size; SamplingParams.n."""

TEMPERATURE = 1.0
"""rollout.temperature; SamplingParams.temperature."""

WARMSTART_STEPS = 900
"""model.warmstart_steps; ensure_default_model(warmstart_steps=)."""

MODEL_CACHE_DIR = "~/.cache/tether/models"
"""model.cache_dir; ensure_default_model(cache_dir=)."""

EVAL_BATCH_SIZE = 200
"""eval.batch_size; heldout_scores / greedy_accuracy(batch_size=)."""

RARE_PROB = 0.05
"""diagnostics.rare_prob; current_model_monitor(rare_prob=)."""

RL_SHARE = 0.25
"""task.rl_share; CountdownTask(rl_share=): problems kept for RL, unseen by the warm start."""
