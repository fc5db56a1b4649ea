"""Named presets: the methods of the papers as (objective, correction, centering) triples.

`format_presets_table()` is what `tether estimators` prints; docs/estimators.md mirrors it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.estimators.registry import CORRECTIONS, OBJECTIVES

DEFAULT_SYNC_POLICY = "every:1"  # a preset's, and a composed estimator's, unless it names one


@dataclass(frozen=True)
class Preset:
    """A named estimator: an objective, a mismatch correction, optional centering."""

    name: str
    objective: str
    correction: str = "none"
    centering: bool = False
    source: str = ""
    params: tuple[tuple[str, object], ...] = ()  # the preset's own defaults over its parts'
    # The method's sync policy (tether.weights.policy syntax): what `sync.policy: auto` picks.
    sync_policy: str = DEFAULT_SYNC_POLICY

    @property
    def corrects(self) -> str:
        """Which cause(s) of disagreement the combination handles."""
        causes = set()
        for side in (
            OBJECTIVES.get(self.objective).corrects,
            CORRECTIONS.get(self.correction).corrects,
        ):
            causes |= {"numerical", "staleness"} if side == "both" else {side} - {"neither"}
        if self.centering:
            causes.add("numerical")
        if causes == {"numerical", "staleness"}:
            return "both"
        return causes.pop() if causes else "neither"

    @property
    def formula(self) -> str:
        objective = OBJECTIVES.get(self.objective).formula
        if self.correction != "none":
            objective = f"[{CORRECTIONS.get(self.correction).formula}] * [{objective}]"
        if self.centering:
            objective += " + A sum_H sg(mu w - rho_tail pi) log pi"
        return objective

    @property
    def agg(self) -> str:
        """The default aggregation: the objective's source's."""
        return OBJECTIVES.get(self.objective).agg

    @property
    def defaults(self) -> dict[str, object]:
        params = dict(OBJECTIVES.get(self.objective).defaults)
        params.update(CORRECTIONS.get(self.correction).defaults)
        params.update(self.params)
        return params


_PPO_SRC = "PPO/GRPO clip (0.2, 0.28) + "
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("naive", "pg", source="REINFORCE; the uncorrected baseline"),
        Preset("grpo", "ppo", source="GRPO (Shao et al. 2024), clip-higher (DAPO)"),
        Preset("tis", "ppo", "tis", source=_PPO_SRC + "TIS (Yao et al. 2025)"),
        Preset("seq_tis", "ppo", "seq_tis", source=_PPO_SRC + "sequence TIS"),
        Preset("mis", "ppo", "mis", source=_PPO_SRC + "MIS (Liu, Li et al. 2025)"),
        Preset("icepop", "ppo", "icepop", source=_PPO_SRC + "IcePop (Ling team 2025)"),
        Preset("seq_mis", "ppo", "seq_mis", source=_PPO_SRC + "sequence MIS"),
        Preset("geo_mis", "ppo", "geo_mis", source=_PPO_SRC + "geometric mask (SkyRL bounds)"),
        Preset(
            "cis", "ppo", "cis", source=_PPO_SRC + "CIS (Yu, Zhao, Li et al., arXiv 2609.32444)"
        ),
        Preset("gspo", "gspo", source="GSPO (Zheng et al., arXiv 2507.18071)"),
        Preset("sapo", "sapo", source="SAPO (Gao et al., arXiv 2511.20347)"),
        Preset("cispo", "cispo", source="CISPO (MiniMax-M1, arXiv 2506.13585); eps_hi: ScaleRL"),
        Preset("vespo", "vespo", source="VESPO (Shen et al., arXiv 2602.10693)"),
        Preset("decoupled", "decoupled", source="AReaL decoupled PPO (Fu et al. 2025)"),
        # CIS's own recipe: AReaL's decoupled loss, its behaviour weight under CIS's cap.
        Preset("decoupled_cis", "decoupled", params=(("behaviour_cap", "cis"),),
               source="AReaL decoupled PPO + CIS cap on pi_prox/mu (CIS-RL's AReaL patch)"),
        Preset(
            "dlc",
            "stale_is",
            centering=True,
            source="DLC (Li, Zhou, Lan); centering: Marek & Ryabinin, arXiv 2609.20807",
            sync_policy="ess:0.5",
        ),
        # dlc with its staleness weight under PPO's clip around pi_old (as tis has it), the
        # centering taking the clipped w(v): does the clip's anchor explain tis's stability?
        Preset("dlc_clip", "ppo", centering=True, source="dlc with w = PPO-clipped r (tether)",
               sync_policy="ess:0.5"),
        Preset("reweight", "total_is", source="DLC's plain reweighting baseline (Li, Zhou, Lan)"),
    )
}


def _format_defaults(defaults: dict[str, object]) -> str:
    return (
        ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in defaults.items())
        or "-"
    )


def presets_rows() -> list[dict[str, str]]:
    """One dict per preset: name, composition, corrects, agg, formula, defaults, source."""
    rows = []
    for p in PRESETS.values():
        composition = f"{p.objective}+{p.correction}" + ("+centering" if p.centering else "")
        rows.append(
            {
                "preset": p.name,
                "composition": composition,
                "corrects": p.corrects,
                "agg": p.agg,
                "formula": p.formula,
                "defaults": _format_defaults(p.defaults),
                "source": p.source,
            }
        )
    return rows


def format_presets_table() -> str:
    """A plain-text table of every preset (what `tether estimators` prints)."""
    rows = presets_rows()
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns).rstrip()]
    lines.append("  ".join("-" * widths[c] for c in columns))
    lines += ["  ".join(r[c].ljust(widths[c]) for c in columns).rstrip() for r in rows]
    lines.append("")
    lines.append("agg is the default aggregation, the source's; every preset also takes agg =")
    lines.append("token-mean, seq-mean-token-mean or seq-mean-token-sum. Compose your own as")
    lines.append("'objective+correction[+centering]' (agg defaults to the objective's).")
    lines.append(f"  objectives:  {', '.join(OBJECTIVES.names())}")
    lines.append(f"  corrections: {', '.join(CORRECTIONS.names())}")
    return "\n".join(lines)
