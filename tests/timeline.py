"""Each xdist worker's chain of tests from a suite run's timeline (tests/conftest.py TIMELINE).

    CLUSTERFLOW_TEST_TIMELINE=/tmp/t.jsonl bash tests/run.sh
    python tests/timeline.py /tmp/t.jsonl

Prints, per worker, when its first test started and its last ended (seconds from the suite's
first start), the seconds it spent in tests, and its groups by time; then which worker ended last,
and, where the timeline holds CPU seconds, the files whose tests cost the most CPU.
"""

import collections
import json
import sys


def main(path: str, top: int = 8) -> None:
    with open(path) as f:
        tests = [json.loads(line) for line in f if line.strip()]
    t0 = min(t["start"] for t in tests)
    by_worker = collections.defaultdict(list)
    for t in tests:
        by_worker[t["worker"]].append(t)
    ends = {}
    for worker, runs in sorted(by_worker.items()):
        first, last = min(t["start"] for t in runs) - t0, max(t["end"] for t in runs) - t0
        busy = sum(t["end"] - t["start"] for t in runs)
        ends[worker] = last
        print(f"{worker}: {len(runs)} tests, {first:.0f}-{last:.0f} s, busy {busy:.0f} s")
        groups = collections.Counter()
        for t in runs:
            groups[t["group"]] += t["end"] - t["start"]
        for group, seconds in groups.most_common(top):
            print(f"    {seconds:7.1f} s  {group[:90]}")
    worker = max(ends, key=ends.get)
    print(f"last to end: {worker} at {ends[worker]:.0f} s")
    cpu = collections.Counter()
    for t in tests:
        cpu[t["test"].split("::")[0]] += t.get("cpu", 0.0)
    if sum(cpu.values()):
        print(f"CPU seconds in tests: {sum(cpu.values()):.0f} (Slurm jobs' not counted); by file:")
        for name, seconds in cpu.most_common(top * 3):
            print(f"    {seconds:7.1f} s  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
