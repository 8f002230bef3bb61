"""Print results/summary.json as the README's tables (markdown): per profile, every policy's steps against
its zero-downtime ideal, the time to the step every policy reached, the downtime and the final loss."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def table(profile: str, entry: dict) -> str:
    common = entry["common_step"]
    lines = [
        f"**{profile}** ({entry['clock']} clock; one trained step = {entry['time_scale']:g} steps of the "
        f"target; run here in {entry['wall_s'] / 60:.1f} min)",
        "",
        f"| policy | steps | ideal | steps / ideal | minutes to step {common} | downtime min | final loss | "
        "max loss diff vs static |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, p in entry["policies"].items():
        match = p.get("loss_vs_static")
        diff = f"{match['max_rel_diff']:.1e} ({match['steps_compared']} steps)" if match else "-"
        lines.append(
            f"| {name} | {p['steps']} | {p['ideal_steps']} | {p['steps'] / p['ideal_steps']:.1%} | "
            f"{p['time_to_common_step_s'] / 60:.0f} | {p['downtime_s'] / 60:.1f} | {p['final_loss']:.3f} | "
            f"{diff} |"
        )
    return "\n".join(lines)


def main(path: str = str(HERE / "results" / "summary.json")) -> None:
    summary = json.loads(Path(path).read_text())
    print("\n\n".join(table(profile, entry) for profile, entry in summary.items()))


if __name__ == "__main__":
    main(*sys.argv[1:])
