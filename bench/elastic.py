"""Elastic workers: examples/s before and after `tf-psx scale` 2 -> 4, and the time the rescale takes.

Child mode (`--chief`) is the training script `tf-psx launch` runs: a
logistic model on planted-logistic ids (8 fields x 1000 ids, batch 256,
Adagrad), PeriodicSync every 200 steps, printing "elastic t=<unix time>
step=<iterations>" every 50 batches. The parent launches it with 2 workers
and 1 ps, runs `tf-psx scale LOG_DIR --workers 4` once 1000 steps were
applied, and reads the lines: examples/s over the last 500 steps before the
command and over 500 steps after the resumed chief's first report, and the
seconds from the command to that first report (the chief and the servers
restart, TF is imported and the step traced again). On 2 cores 4 workers
share the same CPUs as 2: the ratio shows what the restart leaves, not a
speed-up. The ps task keeps running through the rescale: the model carries a
second table of BALLAST_ROWS x BALLAST_DIM (with its Adagrad accumulator,
about 128 MB on the ps), and the ps's resident memory is read before the
command, at every report after it, and while the chief idles IDLE_S after
fit, past tf_psx's keep-alive, to show when the old coordinator's variables
are freed. One run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BATCH, FIELDS, VOCAB, EVERY, REPORT_EVERY = 256, 8, 1000, 200, 50
SCALE_AT, WINDOW, TOTAL = 1000, 500, 3000
BALLAST_ROWS, BALLAST_DIM = 1_000_000, 16
# After fit the chief waits this long (printing "elastic idle" every IDLE_REPORT_S), past tf_psx's
# keep-alive (60 s), so that the stopped chief's context has expired on the ps when the last RSS is read.
IDLE_S, IDLE_REPORT_S = 75, 5
IDLE = re.compile(r"^\[chief:0\] elastic idle t=(?P<t>[\d.]+)")
LINE = re.compile(r"^\[chief:0\] elastic t=(?P<t>[\d.]+) step=(?P<step>\d+)")
RUN_TIMEOUT_S = 900


def chief() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel
    from tf_psx import launch  # pylint: disable=import-outside-toplevel

    data = tf_psx.data.synthetic_ctr(40_000, num_fields=FIELDS, vocab_size=VOCAB, seed=0)
    strategy = tf_psx.ParameterServerStrategy()
    with strategy.scope():
        ids = tf.keras.Input((FIELDS,), dtype=tf.int64)
        logit = tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(tf.keras.layers.Embedding(data.num_rows, 1)(ids)))
        ballast = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(BALLAST_ROWS, BALLAST_DIM)(ids))
        output = tf.keras.layers.Activation("sigmoid")(logit + tf.keras.layers.Dense(1)(ballast))
        model = tf.keras.Model(ids, output)
        model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy")

    class Report(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._supports_tf_logs = True
            self.batches = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1
            if self.batches % REPORT_EVERY == 0:
                print(f"elastic t={time.time():.3f} step={int(self.model.optimizer.iterations.numpy())}", flush=True)

    def dataset_fn(_ctx):
        return tf.data.Dataset.from_tensor_slices((data.ids, data.labels)).shuffle(40_000).repeat().batch(BATCH)

    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=TOTAL, verbose=0,
              callbacks=[tf_psx.callbacks.PeriodicSync(EVERY, launch.snapshot_dir()), Report()])
    for _ in range(IDLE_S // IDLE_REPORT_S):
        time.sleep(IDLE_REPORT_S)
        print(f"elastic idle t={time.time():.3f}", flush=True)


def _ps_rss_mb(log_dir: str) -> float | None:
    """The ps task's resident memory (MB), from the pid the launcher wrote; None if it cannot be read."""
    import json  # pylint: disable=import-outside-toplevel

    from tf_psx import launch  # pylint: disable=import-outside-toplevel

    try:
        with open(os.path.join(log_dir, launch.PIDS_FILE), encoding="utf-8") as handle:
            pid = json.load(handle)["ps:0"]
        with open(f"/proc/{pid}/status", encoding="utf-8") as handle:
            kib = next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))
    except (OSError, KeyError, ValueError, StopIteration):
        return None
    return kib / 1024


def _rate(points: list[tuple[float, int]]) -> float:
    (t0, s0), (t1, s1) = points[0], points[-1]
    return (s1 - s0) * BATCH / (t1 - t0)


def main() -> None:
    from _common import write_result  # pylint: disable=import-outside-toplevel

    log_dir = tempfile.mkdtemp(prefix="tf_psx_bench_elastic_")
    argv = [sys.executable, "-m", "tf_psx.cli", "launch", "--workers", "2", "--ps", "1", "--log-dir", log_dir, "--",
            sys.executable, os.path.abspath(__file__), "--chief"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,  # pylint: disable=consider-using-with
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    timer = threading.Timer(RUN_TIMEOUT_S, proc.kill)
    timer.start()
    before: list[tuple[float, int]] = []
    after: list[tuple[float, int]] = []
    asked_at = None
    resumed = False
    rss_before, rss_after, rss_idle = None, [], []
    for line in proc.stdout:
        if line.startswith("tf-psx launch: scaled to 4 workers"):
            resumed = True  # reports from here on come from the chief of the 4-worker cluster
        if IDLE.match(line):
            rss_idle.append(_ps_rss_mb(log_dir))
        match = LINE.match(line)
        if not match:
            continue
        point = (float(match["t"]), int(match["step"]))
        if asked_at is None:
            before.append(point)
            if point[1] >= SCALE_AT:
                asked_at = time.time()
                rss_before = _ps_rss_mb(log_dir)
                subprocess.run([sys.executable, "-m", "tf_psx.cli", "scale", log_dir, "--workers", "4"], check=True)
        elif resumed:
            after.append(point)
            rss_after.append(_ps_rss_mb(log_dir))
        else:
            before.append(point)  # the old chief, until the launcher stops it
    code = proc.wait()
    timer.cancel()
    if code != 0 or not after:
        raise SystemExit(f"the launch failed (exit {code}) or never resumed; logs in {log_dir}")
    window = WINDOW // REPORT_EVERY
    before_rate = _rate([p for p in before if p[0] <= asked_at][-window - 1:])
    resumed_step = min(step for _, step in after)  # the snapshot the chief restored
    # The first reports of the resumed chief come while its first steps are still queued.
    moving = [p for p in after if p[1] > resumed_step]
    after_rate = _rate(moving[: window + 1])
    restart_s = moving[0][0] - asked_at
    rows = [
        {"metric": "examples/s with 2 workers (before)", "value": round(before_rate, 1)},
        {"metric": "examples/s with 4 workers (after)", "value": round(after_rate, 1)},
        {"metric": "after / before", "value": round(after_rate / before_rate, 3)},
        {"metric": "scale command -> first applied step with 4 workers", "value": round(restart_s, 1), "unit": "s"},
        {"metric": ("steps computed again (last step seen with 2 workers - snapshot resumed from; the ps "
                    "rolled back to the snapshot, so each is applied once)"),
         "value": before[-1][1] - resumed_step},
    ]
    if rss_before is not None and all(rss is not None for rss in rss_after):
        rows += [
            {"metric": "ps RSS before the command", "value": round(rss_before), "unit": "MB"},
            {"metric": "ps RSS at the resumed chief's first report", "value": round(rss_after[0]), "unit": "MB"},
            {"metric": "ps RSS at its last report", "value": round(rss_after[-1]), "unit": "MB"},
        ]
    if rss_idle and rss_idle[-1] is not None:
        rows.append({"metric": f"ps RSS {IDLE_S} s after fit (past the 60 s keep-alive)",
                     "value": round(rss_idle[-1]), "unit": "MB"})
    write_result("elastic", f"tf-psx launch, 1 ps, planted logistic ({FIELDS} fields x {VOCAB} ids, batch {BATCH}, "
                 f"Adagrad) and a {BALLAST_ROWS} x {BALLAST_DIM} table, PeriodicSync every {EVERY} steps; "
                 f"`tf-psx scale --workers 4` after {SCALE_AT} steps with 2 workers (the ps keeps running); rates "
                 f"over {WINDOW} steps before the command and after the first report of the resumed chief.", rows,
                 {"before": before, "after": after, "asked_at": asked_at, "ps_rss_mb": [rss_before, *rss_after],
                  "ps_rss_idle_mb": rss_idle})


if __name__ == "__main__":
    if sys.argv[1:] == ["--chief"]:
        chief()
    else:
        main()
