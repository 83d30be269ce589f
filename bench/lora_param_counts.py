"""Our adapter's LoRA parameters per unit of rank against Tinker's published table, per model.

For every model of `tests/data/lineup/models.json` (the Tinker lineup, one `config.json`-shaped
file per distinct text config), the model is built from its config on the meta device (no
weights, no memory) and counted with the engine's own layout (`workers.engine.lora_counts`):
exactly the linears and fused experts the bank would adapt today, each as the bank stores it.
Tinker's numbers are tinker-cookbook's `_LORA_PARAMS_PER_RANK_BY_COMPONENT` (`attn`, `mlp`,
`unembed`); a user who moves a run between Tinker and us expects the same adapter, so every
difference printed is a layout still to change (see tests/test_lora_counts.py for the models
that already match).

    .venv/bin/python bench/lora_param_counts.py            # table: ours, Tinker's, difference
    .venv/bin/python bench/lora_param_counts.py --json     # one JSON line per model (ours)
    .venv/bin/python bench/lora_param_counts.py Qwen3.5    # only model ids containing a word

Runs offline on the CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path

from transformers.utils import logging as transformers_logging

from workers.engine.lora import LAYER_GROUPS, LayerGroup
from workers.engine.lora_counts import RankCounts, build_on_meta, config_from_fields, count_per_rank

LINEUP = Path(__file__).resolve().parents[1] / "tests" / "data" / "lineup"


def lineup_index() -> dict[str, str]:
    """Model id -> config file name, for every model of the lineup we cover."""
    index: dict[str, str] = json.loads((LINEUP / "models.json").read_text())
    return index


def count_lineup(model_ids: list[str]) -> dict[str, RankCounts]:
    """Our counts for `model_ids`; models sharing a config file are built once."""
    index = lineup_index()
    by_file: dict[str, RankCounts] = {}
    counts: dict[str, RankCounts] = {}
    for model_id in model_ids:
        name = index[model_id]
        if name not in by_file:
            config = config_from_fields(json.loads((LINEUP / name).read_text()))
            by_file[name] = count_per_rank(build_on_meta(config))
        counts[model_id] = by_file[name]
    return counts


def tinker_table() -> Mapping[str, Mapping[str, int]]:
    """Tinker's per-rank counts by model id (empty without tinker-cookbook installed)."""
    try:
        from tinker_cookbook.hyperparam_utils import _LORA_PARAMS_PER_RANK_BY_COMPONENT
    except ImportError:
        return {}
    table: Mapping[str, Mapping[str, int]] = _LORA_PARAMS_PER_RANK_BY_COMPONENT
    return table


def _verdict(ours: int, theirs: int | None) -> str:
    if theirs is None:
        return "no Tinker number"
    return "equal" if ours == theirs else f"{ours - theirs:+,}"


def table(counts: Mapping[str, RankCounts], tinker: Mapping[str, Mapping[str, int]]) -> str:
    width = max(len(model_id) for model_id in counts)
    header = f"{'model':<{width}}  {'component':<9}{'ours':>14}{'Tinker':>14}  ours - Tinker"
    lines = [header, "-" * len(header)]
    equal = 0
    for model_id, count in counts.items():
        theirs = tinker.get(model_id, {})
        verdicts = []
        for group in LAYER_GROUPS:
            ours, their = count.per_group[group], theirs.get(group)
            verdicts.append(_verdict(ours, their))
            their_text = f"{their:,}" if their is not None else "?"
            lines.append(
                f"{model_id:<{width}}  {group:<9}{ours:>14,}{their_text:>14}  {verdicts[-1]}"
            )
        equal += all(v == "equal" for v in verdicts)
        if count.unwrappable_experts:
            lines.append(
                f"{'':<{width}}  {len(count.unwrappable_experts)} expert blocks not adapted "
                f"(not the fused layout), e.g. {count.unwrappable_experts[0]}"
            )
    lines.append(f"{equal} of {len(counts)} models equal to Tinker's table on all three groups")
    return "\n".join(lines)


def json_lines(counts: Mapping[str, RankCounts]) -> str:
    groups: tuple[LayerGroup, ...] = ("mlp", "attn", "unembed")
    return "\n".join(
        json.dumps({"model": model_id, **{g: count.per_group[g] for g in groups}})
        for model_id, count in counts.items()
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("words", nargs="*", help="only model ids containing one of these")
    parser.add_argument("--json", action="store_true", help="one JSON line per model (ours)")
    args = parser.parse_args(argv)
    # config warnings about the fields the lineup files leave to the defaults
    transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    model_ids = [m for m in lineup_index() if not args.words or any(w in m for w in args.words)]
    counts = count_lineup(model_ids)
    print(json_lines(counts) if args.json else table(counts, tinker_table()))


if __name__ == "__main__":
    main()
