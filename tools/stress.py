"""make test-stress: the service and e2e tiers while busy processes hold every core,
round after round, each in a new random order; stops at the first failure and
prints the seed that replays its order."""

import argparse
import contextlib
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A pure-Python spin: one core's worth of work that never sleeps, at the default priority.
BURNER = "while True:\n    pass\n"


@contextlib.contextmanager
def burners(count: int):
    """`count` spinning processes, each a session of its own: where the kernel
    shares CPU between sessions (autogroup), each then competes as an unrelated
    program would, not as a share of this one's."""
    spinning = [
        subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.DEVNULL, start_new_session=True)
        for _ in range(count)
    ]
    try:
        yield spinning
    finally:
        for process in spinning:
            process.kill()
        for process in spinning:
            process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="how many shuffled runs, each with a new seed")
    parser.add_argument("--seed", type=int, help="the first round's seed (to replay a failed round's order)")
    parser.add_argument(
        "--burners", type=int, default=len(os.sched_getaffinity(0)), help="busy processes, one per core by default"
    )
    parser.add_argument("--tiers", default="service or e2e", help="the pytest -m expression to run")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.burners < 0:
        parser.error(f"--burners must be >= 0, got {args.burners}")
    seeds = [args.seed] if args.seed is not None else []
    seeds += [random.SystemRandom().getrandbits(32) for _ in range(args.rounds - len(seeds))]
    with burners(args.burners):
        for round_number, seed in enumerate(seeds, 1):
            print(
                f"test-stress: round {round_number}/{args.rounds}, {args.burners} busy processes, "
                f"--randomly-seed={seed}",
                flush=True,
            )
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-x",
                    "-p",
                    "randomly",
                    f"--randomly-seed={seed}",
                    "-m",
                    args.tiers,
                    *args.pytest_args,
                    "tests",
                ],
                cwd=ROOT,
            )
            if done.returncode != 0:
                print(
                    f"test-stress: round {round_number} failed with --randomly-seed={seed}; replay its order "
                    f"with 'make test-stress SEED={seed} ROUNDS=1' (or without load, 'make test SEED={seed}')",
                    file=sys.stderr,
                    flush=True,
                )
                return done.returncode
    print(f"test-stress: {args.rounds} rounds passed (seeds {', '.join(map(str, seeds))})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
