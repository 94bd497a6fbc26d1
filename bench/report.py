"""What every benchmark shares: progress lines, the machine's description,
quantiles of a service's histograms, the share of the CPU a hypervisor took,
and writing a report as JSON, Markdown and a plot side by side."""

import json
import os
import pathlib
import platform
import time
from collections.abc import Callable


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def cpu_times(stat: pathlib.Path = pathlib.Path("/proc/stat")) -> list[int] | None:
    """The machine's CPU time so far, in ticks: user, nice, system, idle, iowait, irq,
    softirq, steal (the first line of /proc/stat); None where there is no such file."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    return [int(v) for v in fields[1:9]]


def process_cpu_s(pid: int) -> float:
    """The CPU time (user and system, all threads) a process has used so far, in seconds."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_rss_bytes(pid: int) -> int:
    """A process's resident set now (VmRSS), in bytes; OSError once it is gone."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of the CPU time between two cpu_times() that the hypervisor gave to
    other guests (steal): on a shared virtual machine the part of every figure that
    the benchmark did not control."""
    if before is None or after is None:
        return None
    spent = [b - a for a, b in zip(before, after, strict=True)]
    return spent[7] / sum(spent) if sum(spent) else 0.0


def pyplot():
    """matplotlib.pyplot drawing to files only (no display on a server)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: pathlib.Path, report: dict, what: str = "") -> None:
    """Titles a benchmark's figure with the machine and the number of runs, and writes it."""
    runs = f"medians of {report['runs']} runs" if report["runs"] != 1 else "one run"
    fig.suptitle(f"{what + '; ' if what else ''}{report['machine']}; {runs}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(
    out: pathlib.Path, name: str, report: dict, markdown: str, plot: Callable[[dict, pathlib.Path], None] | None = None
) -> None:
    """out/name.json, out/name.md and (given a plot) out/name.png; prints the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(markdown)
    if plot is not None:
        plot(report, out / f"{name}.png")
    print(markdown)


def bucket_quantile(before: dict, after: dict, name: str, q: float, **labels) -> float:
    """The q-quantile of what a Prometheus histogram `name` counted between two
    scrapes (services.common.metrics.scrape), as the upper bound of the bucket
    it falls in (seconds); NaN when nothing was counted."""

    def counts(scraped: dict) -> dict[float, float]:
        out: dict[float, float] = {}
        for (sample, pairs), value in scraped.items():
            found = dict(pairs)
            if sample == name + "_bucket" and all(found.get(k) == v for k, v in labels.items()):
                bound = float(found["le"])
                out[bound] = out.get(bound, 0.0) + value
        return out

    now, then = counts(after), counts(before)
    cumulative = sorted((bound, now[bound] - then.get(bound, 0.0)) for bound in now)
    if not cumulative or cumulative[-1][1] <= 0:
        return float("nan")
    total = cumulative[-1][1]
    return next(bound for bound, count in cumulative if count >= q * total)


# -- method: phase order, spread, goals --------------------------------------------


def seed_argument(parser) -> None:
    """--seed: the seed of every run's phase order (drawn and recorded when not given)."""
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the phases' order in each run (default: drawn, and written to the report)",
    )


def chosen_seed(seed: int | None) -> int:
    """The seed given, or a fresh one; the report records it so the orders can be replayed."""
    import secrets

    return seed if seed is not None else secrets.randbelow(1_000_000)


def phase_order(phases, run: int, seed: int) -> list:
    """The phases of run `run` in an order shuffled by (seed, run): no phase always
    goes first, or always after another, so a drift of the machine during a run
    (a neighbour's load, caches warming, memory filling) falls on every side
    alike; the same seed gives the same orders."""
    import random

    order = list(phases)
    random.Random(f"{seed}:{run}").shuffle(order)
    return order


def spread(values) -> dict:
    """The median, the least and the greatest of per-run values, and the values themselves."""
    import statistics

    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def span(s: dict, fmt: str = "{:.2f}") -> str:
    """A spread as 'median (min–max)'."""
    if s["median"] is None:
        return "–"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def goal_verdict(values, met: Callable[[float], bool]) -> str:
    """'met' only when every run meets the goal, 'not met' when none does, else
    'within the noise' (the spread across runs does not allow a verdict)."""
    outcomes = [met(v) for v in values if v is not None]
    if outcomes and all(outcomes):
        return "met"
    if not any(outcomes):
        return "not met"
    return f"within the noise ({sum(outcomes)} of {len(outcomes)} runs meet it)"
