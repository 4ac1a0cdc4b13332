#!/usr/bin/env python3
"""Tests of the torch judge's driver (scripts/torch_judge.py) that need no GPU and no PyTorch:
its workers are replaced by a stub that answers the lockstep protocol, so what is checked is
how the driver schedules the interleaved steps and reads their answers.

    python3 scripts/test_torch_judge.py
"""

import contextlib
import io
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch_judge  # noqa: E402

# A lockstep worker that answers at once. A step's time is its index in ms, plus 1 ms for
# pinpool's processes, so that the driver's bookkeeping can be read back from the figures.
STUB = r"""
import sys
mode = sys.argv[1]
print("@@ ready", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "build":
        print("@@ built", flush=True)
    elif cmd[0] == "step":
        ms = int(cmd[1]) + (1 if mode == "pinpool" else 0)
        own = " 0.001" if mode == "pinpool" else ""
        print(f"@@ {ms / 1000:.6f} 0.002 0.003 4{own}", flush=True)
    elif cmd[0] == "drop":
        print("@@ dropped", flush=True)
    elif cmd[0] == "quit":
        break
"""


class Lockstep(unittest.TestCase):
    def run_lockstep(self, procs, turn):
        os.environ["PINPOOL_JUDGE_CPU"] = "none"
        os.environ["PINPOOL_JUDGE_PROCS"] = str(procs)
        os.environ["PINPOOL_JUDGE_TURN"] = str(turn)
        os.environ.pop("PINPOOL_JUDGE_MODELS", None)
        with tempfile.TemporaryDirectory() as out:
            stub = os.path.join(out, "stub.py")
            with open(stub, "w") as f:
                f.write(STUB)
            judge = torch_judge.Judge(stub, out, 120)
            judge.worker_cmd = lambda part, mode, o: [sys.executable, stub, mode]
            with contextlib.redirect_stdout(io.StringIO()):
                judge.lockstep()
            judge.log_file.close()
            return judge.summary

    def test_every_configuration_times_every_step_once_split_between_its_processes(self):
        for procs, turn in [(1, 3), (2, 3), (3, 2)]:
            with self.subTest(procs=procs, turn=turn):
                summary = self.run_lockstep(procs, turn)
                lock = summary["lockstep"]
                for name, (_, _, warmup, steps) in torch_judge.chosen_models("cuda:0").items():
                    for mode in torch_judge.COMPARED:
                        times = lock["times_ms"][mode][name]
                        extra = 1 if mode == "pinpool" else 0
                        # The timed steps are warmup .. warmup + steps - 1, in order, once each.
                        self.assertEqual([round(t) - extra for t in times],
                                         list(range(warmup, warmup + steps)))
                        # Turn n went to process n % procs.
                        self.assertEqual(lock["ranks"][mode][name],
                                         [(j // turn) % procs for j in range(steps)])
                        # pinpool's workers also answer with its own threads' CPU seconds.
                        own = [0.001] if mode == "pinpool" else []
                        self.assertEqual(lock["host"][mode][name],
                                         [[0.002, 0.003, 4.0] + own] * steps)

    def test_the_verdict_compares_medians_with_the_fastest_of_pytorchs_three(self):
        summary = self.run_lockstep(2, 3)
        for name, (_, _, warmup, steps) in torch_judge.chosen_models("cuda:0").items():
            verdict = summary["verdicts"][f"time {name}"]
            # pinpool's steps take 1 ms more than each of PyTorch's: within 1.05x only where
            # the median step is at least 20 ms.
            median = warmup + (steps - 1) / 2
            self.assertEqual(verdict["ok"], median + 1 <= 1.05 * median, (name, verdict))


class Variants(unittest.TestCase):
    def test_one_setting_is_the_variant_and_several_are_numbered(self):
        self.assertEqual(torch_judge.variant_modes(None), {})
        self.assertEqual(torch_judge.variant_modes(" ; "), {})
        one = "thread_cache_mb:16,reserve_cap:1.1"
        self.assertEqual(torch_judge.variant_modes(one), {"variant": one})
        self.assertEqual(torch_judge.variant_modes(f"{one}; reserve_cap:1.1,linger_us:2000"),
                         {"variant1": one, "variant2": "reserve_cap:1.1,linger_us:2000"})


class Cpus(unittest.TestCase):
    @unittest.skipUnless(os.path.exists("/proc/thread-self/schedstat"), "no schedstat in /proc")
    def test_the_cpu_of_threads_named_pinpool_is_counted_and_of_no_other(self):
        import threading
        import time

        def busy(name, secs):
            with open("/proc/thread-self/comm", "w") as f:
                f.write(name)
            end = time.thread_time() + secs
            while time.thread_time() < end:
                pass

        before = torch_judge.own_threads_cpu()
        other = threading.Thread(target=busy, args=("other-worker", 0.2))
        other.start()
        other.join()
        self.assertLess(torch_judge.own_threads_cpu() - before, 0.05)
        spun, done = threading.Event(), threading.Event()
        ours = threading.Thread(target=lambda: (busy("pinpool-torch", 0.1), spun.set(), done.wait()))
        ours.start()
        # Counted while the thread lives: /proc lists only live threads.
        self.assertTrue(spun.wait(30))
        counted = torch_judge.own_threads_cpu() - before
        done.set()
        ours.join()
        self.assertGreaterEqual(counted, 0.09)

    def test_a_named_cpu_is_taken_and_an_unknown_one_leaves_the_scheduler(self):
        cpu = min(os.sched_getaffinity(0))
        os.environ["PINPOOL_JUDGE_CPU"] = str(cpu)
        self.assertEqual(torch_judge.timing_cpu()[0], cpu)
        os.environ["PINPOOL_JUDGE_CPU"] = "100000"
        self.assertIsNone(torch_judge.timing_cpu()[0])
        os.environ["PINPOOL_JUDGE_CPU"] = "none"
        self.assertIsNone(torch_judge.timing_cpu()[0])

    def test_auto_picks_the_fastest_cpu_of_those_allowed(self):
        os.environ["PINPOOL_JUDGE_CPU"] = "auto"
        cpu, why = torch_judge.timing_cpu()
        self.assertIn(cpu, os.sched_getaffinity(0))
        self.assertIn("fastest", why)


if __name__ == "__main__":
    unittest.main()
