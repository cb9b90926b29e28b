"""`ecrec bench paper`: the ECRec paper's evaluation (§5, Figs. 5-13) in one run, scaled down to one machine.

One invocation runs every job it needs through `ecrec local`'s `run_local` (each job once: a run serves every
figure that needs it), then writes `results.json` (the numbers), PNG figures and `report.md` (the numbers
beside the paper's, the scaling rule, the departures) into `--out`. Ratios compare runs of one invocation;
absolute numbers hold only for the machine named in the report.

The scaling rule (README of the report says it again): the paper trains Criteo-Original (220 GB) and its
2S/4S/8S variants for two hours with checkpoints every 30 (Ckpt-30) or 60 minutes (Ckpt-60); its Fig. 5 puts
Ckpt-30's overhead at 65% on 8S, 7.2x what it is on Original, so one checkpoint of Original takes about
0.09 of a 30-minute interval. Here model ×1 is `examples/local-small.yaml` (×2, ×4, ×8 multiply every table,
as `model.scale`); a calibration run measures the pause of one checkpoint of ×1, and the short interval is
that pause / 0.09, the long one twice it: checkpoint time / interval of ×1 is the paper's. Intervals are
given to the jobs in steps (`intervalSteps`: the short interval's seconds at the No FT step rate of the same
model size), so every rank checkpoints at the same step and a failure "mid-interval" (the paper's failure at
15 minutes, half of Ckpt-30's interval) is a kill at a step: (m + 1/2) short intervals.

Modules, each importing only those above it:
  paper        the papers' own numbers
  plan         what one invocation runs (`FULL`, `QUICK`) and the contention threshold
  runs         `Run`, one job's numbers, and the labels and training time read off it
  runner       `Runner`: each job run once through `ecrec local`, cached in WORK/runs.json
  metrics      numbers out of one run: pauses, recovery times, checkpoint cases, load, sizes
  jobs         `Jobs`: the jobs the sections share and the scaling rule (intervals, kill step)
  experiments  `PaperBench(Jobs)`: the sections, each returning its numbers; `run_all`
  figures      the PNG figures, from results.json
  report       report.md, from results.json, one function per section
  command      `bench_paper`: run or re-render, write results.json, figures and report

What cli.py and the tests import from `ecrec.paperbench` is re-exported here (`__all__`).
"""

from __future__ import annotations

from ecrec.paperbench.command import bench_paper
from ecrec.paperbench.experiments import PaperBench
from ecrec.paperbench.metrics import ckpt_cases, load_of
from ecrec.paperbench.plan import FULL, QUICK
from ecrec.paperbench.runs import time_to_samples

__all__ = ["FULL", "QUICK", "PaperBench", "bench_paper", "ckpt_cases", "load_of", "time_to_samples"]
