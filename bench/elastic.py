"""One rank killed under torchrun, again and again: does the group restart, resume and finish bit-identically?

    python -m bench.elastic                     # 20 kills: both train.ddp_sync modes, one node and two agents
    python -m bench.elastic --kills 4 --modes agreed --layouts one-node

Each kill is a fresh run of the one command torchrun reruns (``train.py ... --resume auto``) under
``torchrun --max-restarts 1`` on the small synthetic dataset (2 gloo processes, tiny3d at 32x32), with rank 1
SIGKILLed at a random optimizer step after the first last.pt (``--any-rank``: rank 0, the one that writes, and
rank 1 in turn); the final weights are compared with an uninterrupted run of the same command, bit for bit.
``two-agents`` runs two torchrun agents on localhost (a c10d rendezvous, ``--nnodes 2``, one process each). It
prints a row per kill and the count that finished bit-identically; a kill that fails prints why (exit code, the
last lines of its agents' output).

tests/elastic_harness.py launches, kills and compares the groups, for tests/test_elastic.py too. Load: the 2 cores run
both workers, the agents and the decoders.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile

from tests.elastic_harness import LAYOUTS, MODES, final_weights, identical, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="kills in all, spread over the modes and layouts")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--any-rank", action="store_true", help="kill rank 0 and rank 1 in turn (default: rank 1)")
    args = parser.parse_args()
    from datasets.synthetic import generate  # the bench writes its own small dataset

    modes, layouts = args.modes.split(","), args.layouts.split(",")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as root:
        data = os.path.join(root, "data")
        generate(
            data,
            seed=3,
            size=32,
            num_train=18,
            num_val=6,
            num_test=6,
            short_frames=20,
            num_long=1,
            long_frames=300,
            num_multiview=6,
            quiet=True,
        )
        references = {}
        for mode in modes:
            result = run(data, os.path.join(root, f"reference-{mode}"), "one-node", mode)
            assert result["codes"] == [0], result["log"][-2000:]
            references[mode] = final_weights(os.path.join(root, f"reference-{mode}"))
        good = 0
        print(f"{'kill':>4s} {'layout':>10s} {'mode':>7s} {'rank':>4s} {'step':>4s} {'exit':>6s} {'s':>5s}  result")
        for kill in range(args.kills):
            layout, mode = layouts[kill % len(layouts)], modes[(kill // len(layouts)) % len(modes)]
            out = os.path.join(root, f"kill-{kill}")
            rank = kill // (len(layouts) * len(modes)) % 2 if args.any_rank else 1
            result = run(data, out, layout, mode, kill_at=rng.randint(2, 9), rank=rank)
            ok = (
                all(code == 0 for code in result["codes"])
                and result["killed_at"] is not None
                and not result["temps"]
                and not result["left"]
                and identical(final_weights(out), references[mode])
            )
            good += ok
            print(
                f"{kill:>4d} {layout:>10s} {mode:>7s} {rank:>4d} {str(result['killed_at']):>4s} "
                f"{','.join(map(str, result['codes'])):>6s} {result['seconds']:5.1f}  "
                f"{'bit-identical' if ok else 'FAILED'}",
                flush=True,
            )
            if not ok:
                print("\n".join("      " + line for line in result["log"].splitlines()[-15:]), flush=True)
        print(f"{good} of {args.kills} kills finished bit-identically")


if __name__ == "__main__":
    main()
