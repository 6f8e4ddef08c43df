"""A change against the version before, read against the same benchmark's change against
an identical copy: A/B runs and A/A runs made alternately on one machine.

One run of ``benchmarks/run.py`` beside a version before gives each variant's change over the
floor (the median over its rounds; see ``report.before_changes``). Two copies of the same code
differ too, by how the process lays them out: on an H200, f's variants came out 0.024 and
0.049 apart in one A/A run. So a limit like "within 0.02" is read here against that
spread: ``--pairs`` pairs of runs, an A/B run (``--baseline``, the version before) and an
A/A run (``--copy``, the current code again: ``scripts/make_baseline.sh HEAD DIR``) in
turns, each a process of its own, and per variant the changes of both kinds and the
difference of their means:

    bash scripts/make_baseline.sh 66cb5f5 && bash scripts/make_baseline.sh HEAD benchmarks/baseline/aa
    python benchmarks/ab_aa.py --workloads f --repeats 25 --pairs 3 \\
        --baseline benchmarks/baseline --copy benchmarks/baseline/aa --out ab_aa

Each run's results stay in ``--out`` (``ab-1/``, ``aa-1/``, ...), and the summary goes to
``--out/summary.json`` as well as the screen.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import before_changes  # noqa: E402


def one_run(baseline: str, out: pathlib.Path, args: argparse.Namespace) -> dict[str, float]:
    """One ``run.py`` beside ``baseline``: each variant's median change over the floor."""
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "run.py"),
        "--workloads",
        args.workloads,
        "--repeats",
        str(args.repeats),
        "--no-compile",
        "--baseline",
        baseline,
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    results = json.loads((out / "results.json").read_text())["results"]
    return {
        f"{result['workload']}: {variant}": statistics.median(change)
        for result in results
        for variant, (_, _, change) in before_changes(result, args.kind).items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="f", help="as run.py's (a,b,...)")
    parser.add_argument("--repeats", type=int, default=25, help="rounds of each run")
    parser.add_argument("--pairs", type=int, default=3, help="A/B and A/A runs, in turns")
    parser.add_argument("--baseline", required=True, help="the version before's folder")
    parser.add_argument("--copy", required=True, help="a copy of the current code's folder")
    parser.add_argument("--kind", default="CPU", choices=["CPU", "wall"], help="the time read")
    parser.add_argument("--out", default="benchmarks/results/ab_aa", help="folder of the runs")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, float]]] = {"ab": [], "aa": []}
    for pair in range(1, args.pairs + 1):
        # The order of the two alternates too: neither always runs first.
        kinds = ["ab", "aa"] if pair % 2 else ["aa", "ab"]
        for kind in kinds:
            baseline = args.baseline if kind == "ab" else args.copy
            runs[kind].append(one_run(baseline, out / f"{kind}-{pair}", args))
            print(f"pair {pair}, {kind}: done", flush=True)
    summary = {}
    print(f"\n{args.kind} time, change over the floor (median of each run's rounds):")
    print("| variant | A/B runs | A/A runs | A/B mean - A/A mean | A/A's largest |")
    print("| --- | --- | --- | ---: | ---: |")
    for variant in runs["ab"][0]:
        ab = [run[variant] for run in runs["ab"]]
        aa = [run[variant] for run in runs["aa"]]
        difference = statistics.fmean(ab) - statistics.fmean(aa)
        widest = max(abs(x) for x in aa)
        summary[variant] = {"ab": ab, "aa": aa, "difference": difference, "aa_widest": widest}
        shown = ", ".join(f"{x:+.3f}" for x in ab), ", ".join(f"{x:+.3f}" for x in aa)
        print(f"| {variant} | {shown[0]} | {shown[1]} | {difference:+.3f} | {widest:.3f} |")
    (out / "summary.json").write_text(
        json.dumps({"args": vars(args), "variants": summary}, indent=1)
    )


if __name__ == "__main__":
    main()
