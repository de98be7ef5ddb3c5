"""The bench's parsing and arithmetic (bench/parse.py, bench/report.py, bench/twin.Steady): no processes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench import parse, report
from bench.measure import Spec

KIT_LINES = [
    "(RayTrainWorker pid=1) run r: resnet18 on synthetic, 64 steps/epoch x 2 epochs, world size 2",
    "(RayTrainWorker pid=1) epoch 0 step 5/128 loss 2.3000 lr 0.05 100 samples/s eta 0:00:09",
    "(RayTrainWorker pid=1) epoch 0 step 10/128 loss 2.2000 lr 0.05 400 samples/s eta 0:00:08",
    "(RayTrainWorker pid=1) epoch 0 step 15/128 loss 2.1000 lr 0.05 1,600 samples/s eta 0:00:07",
]


def test_progress_lines_of_kit_and_twin():
    rows = parse.progress_lines(KIT_LINES + ["epoch 1 step 70/128 loss 1.5000"])
    assert [r["step"] for r in rows] == [5, 10, 15, 70]
    assert rows[2]["sps"] == 1600.0 and rows[3]["sps"] is None
    assert parse.loss_trace(rows)[0] == (5, 2.3)


def test_steady_rate_combines_intervals_after_the_skipped_steps():
    rows = parse.progress_lines(KIT_LINES)
    # steps 6-10 at 400/s and 11-15 at 1600/s, 64 samples each step: 640 samples in 0.8 + 0.2 s
    assert parse.steady_from_progress(rows, global_batch=64, skip_steps=5) == pytest.approx(640.0)
    assert parse.steady_from_progress(rows[:1], global_batch=64, skip_steps=5) is None


def test_steady_rate_stops_at_a_resumed_attempt():
    rows = parse.progress_lines(KIT_LINES + ["epoch 0 step 8/128 loss 2.2 lr 0.05 10 samples/s eta 0"])
    assert parse.steady_from_progress(rows, global_batch=64, skip_steps=5) == pytest.approx(640.0)


def test_same_losses():
    a = [(5, 2.3), (10, 2.2)]
    assert parse.same_losses(a, [(5, 2.3), (10, 2.2), (15, 2.1)]) is True
    assert parse.same_losses(a, [(5, 2.3), (10, 2.25)]) is False
    assert parse.same_losses(a, [(7, 2.3)]) is None


def test_prometheus_text():
    text = "\n".join([
        "# HELP ray_app_step_seconds x", "# TYPE ray_app_step_seconds histogram",
        'ray_app_step_seconds_bucket{le="0.1"} 3.0', "ray_app_step_seconds_count 7.0",
        "ray_app_step_seconds_sum 0.5", 'ray_app_info{run="r",model="m"} 1.0'])
    m = parse.parse_prom(text)
    assert m["ray_app_step_seconds_count"] == 7.0 and m["ray_app_info"] == 1.0
    assert "ray_app_step_seconds_bucket" not in m


def test_session_start_is_the_time_in_the_directory_name():
    t = parse.session_start(Path("/tmp/ray/session_2026-11-30_05-00-25_015726_27576"))
    expect = time.mktime(time.strptime("2026-11-30 05:00:25", "%Y-%m-%d %H:%M:%S")) + 0.015726
    assert t == pytest.approx(expect)


def _write_train_logs(logs: Path, t: float) -> None:
    (logs / "train").mkdir(parents=True)
    rows = [
        (t + 1, "controller", "Requesting resources"),
        (t + 2, "controller", "Attempting to start training worker group of size 2"),
        (t + 5, "controller", "[Worker Group Initialization] 2 worker actors created in 3.00s."),
        (t + 9, "controller", "[Worker Group Initialization] Train context initialized on workers in 4.00s."),
        (t + 9.2, "controller", "Started training worker group of size 2: \n- (ip=1.2.3.4, pid=111) world_rank=0, "
                                "local_rank=0\n- (ip=1.2.3.4, pid=222) world_rank=1, local_rank=1"),
        (t + 9.1, "worker", "Setting up process group for: env:// [rank=0, world_size=2]"),
        (t + 9.3, "worker", "Rank 0: Launching training function."),
        (t + 9.4, "worker", "Rank 1: Launching training function."),
        (t + 11.0, "worker", "Moving model to device: cpu"),
        (t + 11.5, "worker", "Moving model to device: cpu"),
    ]
    with open(logs / "train" / "ray-train-sys-controller-x.log", "w") as f:
        for ts, comp, msg in rows:
            f.write(json.dumps({"message": msg, "component": comp, "timestamp_ns": int(ts * 1e9),
                                "run_name": "r1"}) + "\n")


def test_train_events_and_worker_pids(tmp_path):
    t = 1_800_000_000.0
    _write_train_logs(tmp_path, t)
    records = parse.train_log_records(tmp_path, t, t + 100)
    ev = parse.train_events(records)
    assert ev["controller_up"] == pytest.approx(t + 1)
    assert ev["workers_created"] == pytest.approx(t + 5)
    assert ev["train_fn_launched"] == pytest.approx(t + 9.4)  # the slower rank
    assert ev["model_built"] == pytest.approx(t + 11.5)
    assert parse.worker_pids(records, "r1") == {0: 111, 1: 222}
    assert parse.worker_pids(records, "other") == {}
    assert parse.train_log_records(tmp_path, t + 50, t + 100) == []


def test_kit_phases_prefer_the_kit_timeline():
    t0 = 100.0
    logs = {"ray_session": 102.0, "driver_connected": 110.0, "controller_up": 115.0, "workers_created": 120.0,
            "context_ready": 125.0, "train_fn_launched": 125.5, "ddp_wrapping": 127.0}
    timeline = {"ray_ready_unix": 111.0, "worker_start_unix": 126.0, "model_ready_unix": 128.0}
    ev = parse.kit_events(t0, logs, timeline, first_step=128.5)
    ph = parse.phases(ev, parse.KIT_COLD_PHASES)
    assert ph["CLI + imports + config + preflight"] == 2.0
    assert ph["Ray start (ray.init)"] == 9.0
    assert ph["data + model + DDP"] == 2.0
    assert ph["restore + first step"] == 0.5
    assert sum(ph.values()) == pytest.approx(28.5)  # the phases tile t0 -> first step
    no_timeline = parse.phases(parse.kit_events(t0, logs, {}, None), parse.KIT_COLD_PHASES)
    assert no_timeline["Ray start (ray.init)"] == 8.0 and "restore + first step" not in no_timeline


def test_twin_steady_counts_from_the_end_of_the_skipped_step():
    from bench.twin import Steady

    s = Steady(skip=2)
    for step, now in ((1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5)):
        s.on_step(step, now, 1.0, samples=10)
    f = s.figures()
    assert f["steady_samples"] == 20
    assert f["steady_samples_per_second"] == pytest.approx(20 / 2.5)  # wall from the end of step 2
    assert f["steady_step_samples_per_second"] == pytest.approx(20 / 2.0)  # the two steps' own time


def test_spec_value_is_the_last_override():
    spec = Spec("kit", ("data.batch_size=16", "train.epochs=2", "data.batch_size=64"), workers=2)
    assert spec.value("data.batch_size") == "64" and spec.global_batch == 128
    assert spec.metrics_on and not Spec("kit", ("metrics.enabled=false",)).metrics_on


def test_table_marks_met_and_missing():
    rows = [{"case": "a", "metric": "m", "kit": 98.0, "ref": 100.0, "ratio": 0.98, "target": ">= 0.98",
             "ok": True, "note": ""},
            {"case": "g", "metric": "n", "kit": None, "ref": 1.0, "ratio": None, "target": "<= 0.01", "ok": False,
             "note": ""}]
    lines = report.table_lines(rows)
    assert "| (a) | m | 98.00 | 100.00 | 0.980 | >= 0.98 | yes |" in lines
    assert lines[-1].endswith("| - | 1.00 | - | <= 0.01 | NO |")


def test_dataparallel_is_skipped_with_a_reason_below_two_gpus():
    assert "skipped" in report.dataparallel_note(0) and "at least 2" in report.dataparallel_note(1)
    assert "skipped" not in report.dataparallel_note(2)


def test_flops_and_mfu(monkeypatch):
    from bench import flops

    monkeypatch.delenv("BENCH_GPU_PEAK_TFLOPS", raising=False)
    assert flops.peak_flops("NVIDIA H200")[0] == 989e12 and flops.peak_flops("NVIDIA GH200 480GB")[0] == 989e12
    assert flops.peak_flops("NVIDIA L40S")[0] == 362e12 and flops.peak_flops("Something")[0] is None
    monkeypatch.setenv("BENCH_GPU_PEAK_TFLOPS", "100")
    assert flops.peak_flops("Something")[0] == 100e12
    # wide_mlp at 32x32x3: 3072-3072-3072-3072-10 linear layers: 2 FLOPs per weight forward, 4 backward,
    # except the first layer, whose input needs no gradient (2 backward)
    per_sample = flops.flops_per_sample(("data.name=synthetic", "model.name=wide_mlp", "data.args.image_size=32"))
    weights = 3072 * 3072 * 3 + 3072 * 10
    assert per_sample == pytest.approx(6 * weights - 2 * 3072 * 3072, rel=0.001)
    assert flops.mfu(per_sample, 1000.0, 1e15) == pytest.approx(per_sample * 1000 / 1e15)
    assert flops.mfu(None, 1.0, 1.0) is None


def _fake_run(label: str, sps: float) -> dict:
    return {"label": label, "rc": 0, "load1": 1.0, "steady_sps": sps, "wall_s": 30.0, "t0": 0.0, "t_end": 30.0}


def test_merge_keeps_the_earlier_cases_and_the_new_runs(tmp_path):
    """--merge: re-run case (g) only; (a) comes from an earlier results.json, (g)'s old runs are dropped."""
    from bench.run import Plan, Runner, merge, rows_g

    plan = Plan("full", ("kit",))
    runner = Runner(plan, ["g"], 2, tmp_path)
    for rnd in range(2):  # what a run of --cases g --rounds 2 leaves
        for spec, label in runner.schedule(rnd).items():
            runner.results[(spec, rnd)] = _fake_run(label, 100.0 if "off" in label else 99.5)
    old = {"machine": {"date": "earlier", "load_average": "1 1 1"},
           "runs": [_fake_run(f"a/{n} round {r}", 300.0) for n in ("kit", "twin") for r in (1, 2, 3)]
           + [_fake_run(f"g/off round {r}", 999.0) for r in (1, 2, 3)]}
    machine = {}
    cases = merge(runner, ["g"], old, machine)
    assert cases == ["a", "g"] and runner.rounds == 3
    assert len(runner.runs("a", "kit")) == 3 and len(runner.runs("g", "off")) == 2  # the old g runs are gone
    (row,) = rows_g(runner)
    assert row["ratio"] == pytest.approx(0.005) and row["ok"]
    assert "cases a from the bench of earlier" in machine["merged"][0]


def test_merge_never_mixes_two_benches_in_one_case(tmp_path):
    """--merge of a re-run case (p) whose "a on" is case (a)'s kit run: (p) keeps the new run, (a) its own."""
    from bench.run import Plan, Runner, merge

    runner = Runner(Plan("full", ("kit",)), ["p"], 1, tmp_path)
    for spec, label in runner.schedule(0).items():
        runner.results[(spec, 0)] = _fake_run(label, 100.0)
    old = {"machine": {"date": "earlier", "load_average": "1 1 1"},
           "runs": [_fake_run(f"a/{n} round 1", 300.0) for n in ("kit", "twin")]}
    merge(runner, ["p"], old, {})
    assert runner.runs("p", "a on")[0]["steady_sps"] == 100.0
    assert [r["steady_sps"] for r in runner.runs("a", "kit") + runner.runs("a", "twin")] == [300.0, 300.0]
    assert len(runner.all_runs()) == 4 + 2  # p's four processes, then (a)'s two from the earlier bench


def test_results_json_stays_out_of_the_source_tree(tmp_path):
    from bench.run import BENCH, REPO, results_json_path

    assert results_json_path(BENCH) == REPO / "build" / "bench" / "results.json"
    assert results_json_path(BENCH / "gpu") == REPO / "build" / "bench" / "gpu" / "results.json"
    assert results_json_path(tmp_path) == tmp_path / "results.json"


def test_process_roles_from_command_lines():
    assert parse.process_role(["ray::RayTrainWorker.__init__"]) == "ray::RayTrainWorker"
    assert parse.process_role(["ray::TrainController.run", ""]) == "ray::TrainController"
    assert parse.process_role(["ray::IDLE"]) == "ray::IDLE"
    assert parse.process_role(["/x/site-packages/ray/core/src/ray/raylet/raylet", "--flag"]) == "raylet"
    assert parse.process_role(["/v/bin/python", "-u", "/x/dashboard/dashboard.py", "--a"]) == "dashboard.py"
    assert parse.process_role(["/v/bin/python", "-m", "ray_app", "train"]) == "-m ray_app"
    assert parse.process_role(["/v/bin/python3", "/v/bin/ray", "job", "submit"]) == "ray job"
    assert parse.process_role(["/v/bin/python", "/v/bin/torchrun", "--standalone"]) == "torchrun"
    assert parse.process_role(["/v/bin/python", "-B", "-c", "from multiprocessing.forkserver import main; main(1)"]) \
        == "-c from multiprocessing.forkserver import main"
    assert parse.process_role([]) == ""


def test_cpu_by_role_counts_only_up_to_the_first_step():
    t0 = 100.0
    procs = {
        # a cluster process from before the run: only what it used after t0 counts
        1: {"created": 50.0, "role": "raylet", "points": [(100.1, 30.0), (101.1, 30.5), (103.1, 31.5)]},
        # two workers started during the run; the first step comes at 102.1, between samples
        2: {"created": 100.5, "role": "ray::RayTrainWorker", "points": [(101.1, 1.0), (103.1, 3.0)]},
        3: {"created": 100.6, "role": "ray::RayTrainWorker", "points": [(101.1, 0.5), (102.1, 2.0)]},
        # started after the first step: not counted
        4: {"created": 102.5, "role": "ray::DatasetManager", "points": [(103.1, 1.0)]},
    }
    got = parse.cpu_by_role(procs, until=102.1, t0=t0)
    assert got["roles"]["raylet"] == [1, 1.0]
    assert got["roles"]["ray::RayTrainWorker"] == [2, 4.0]
    assert "ray::DatasetManager" not in got["roles"]
    assert got["total"] == 5.0
    assert list(got["roles"]) == ["ray::RayTrainWorker", "raylet"]


def test_case_h_streams_the_same_workload_and_reports_the_median_round_ratio(tmp_path):
    """(h): the streamed run is workload (a) with data.name=shards on the bench's S3 server, nothing else changed;
    the row is the median of the per-round streamed / map-style ratios, the S3 server's CPU beside."""
    from bench.run import Plan, Runner, rows_h

    for size in ("full", "smoke"):
        plan = Plan(size, ("kit",))
        local, st = plan.specs["h"]["map-style"], plan.specs["h"]["streamed"]
        assert st.value("data.name") == "shards" and st.value("data.path") == "s3://ray-app-test/bench-shards/h"
        assert not any(o.startswith("data.args.") for o in st.overrides)
        for key in ("model.name", "data.batch_size", "train.epochs", "train.max_steps", "metrics.enabled"):
            assert st.value(key) == local.value(key), key
        assert (st.workers, st.launch, st.storage) == (local.workers, local.launch, "s3")
        overrides, dest, _ = plan.shard_sets["h"]
        assert dest == st.value("data.path") and overrides[0] == "data.name=synthetic"
    runner = Runner(Plan("full", ("kit",)), ["h"], 3, tmp_path)
    sps = {"map-style": (300.0, 320.0, 310.0), "streamed": (285.0, 256.0, 310.0)}  # ratios 0.95, 0.8, 1.0
    for rnd in range(3):
        for spec, label in runner.schedule(rnd).items():
            name = label.split("/")[1].split(" round")[0]
            run = _fake_run(label, sps[name][rnd])
            run["cpu_in_run"] = {"total": 100.0, "roles": {"moto_server": [1, 8.0 if name == "streamed" else 0.5]}}
            runner.results[(spec, rnd)] = run
    runner.shards_written["h"] = {"shards": 63, "bytes": 63e6}
    ratio, moto = rows_h(runner)
    assert ratio["ratio"] == pytest.approx(0.95) and ratio["ok"] and ratio["target"] == ">= 0.9"
    assert (ratio["kit"], ratio["ref"]) == (285.0, 310.0)
    assert "63 shards of 1.00 MB" in ratio["note"] and "per round 0.950, 0.800, 1.000" in ratio["note"]
    assert (moto["kit"], moto["ref"], moto["ratio"]) == (8.0, 100.0, 0.08)
    assert "map-style runs: 0.5 s" in moto["note"]


def test_a_figure_without_a_reference_by_design_is_well_formed_a_missing_reference_is_not(tmp_path):
    from bench.run import Plan, Runner, _row, problems

    runner = Runner(Plan("full", ("kit",)), ["c"], 1, tmp_path)
    single = _row("c", "the default job, Ray ready -> first step (s)", 7.0, None, None, "<= 8 s", True, single=True)
    paired_row = _row("c", "the default job, wall clock (s; ratio = kit / twin)", 16.0, None, None, "<= 1.6", False)
    assert problems(runner, [single]) == []
    assert problems(runner, [paired_row]) == ["(c) the default job, wall clock (s; ratio = kit / twin): no figure "
                                              "(kit 16.0, reference None)"]


def test_the_default_job_runs_as_on_a_laptop_nothing_scraping_its_exporter():
    """A scraped exporter waits at the end for a scrape of its last values; nobody scrapes `make train`."""
    from bench.run import Plan

    c = Plan("full", ("kit",)).specs["c"]
    assert c["kit default"].metrics_on and not c["kit default"].scraped
    assert c["kit cold"].scraped and c["kit warm"].scraped


def test_case_r_turns_every_ranks_pace_off_only_and_reports_the_median_round_cost(tmp_path):
    """(r): "off" is the "on" run with metrics.rank_pace=false, nothing else changed; "on" is case (a)'s and
    (b)'s kit run; the row's ratio is 1 - the median of the per-round on / off ratios."""
    from bench.run import Plan, Runner, rows_r

    for size in ("full", "smoke"):
        specs = Plan(size, ("kit",)).specs["r"]
        on, off = specs["a on"], specs["a off"]
        assert off.overrides == on.overrides + ("metrics.rank_pace=false",) and on.value("metrics.rank_pace") is None
        assert (off.workers, off.launch) == (on.workers, on.launch)
    plan = Plan("full", ("kit",))
    assert plan.specs["r"]["a on"] == plan.specs["a"]["kit"] and plan.specs["r"]["b on"] == plan.specs["b"]["kit"]
    runner = Runner(plan, ["r"], 3, tmp_path)
    sps = {"a on": (99.0, 100.0, 101.0), "a off": (100.0, 100.0, 100.0),  # ratios 0.99, 1.0, 1.01
           "b on": (50.0, 49.0, 50.0), "b off": (50.0, 50.0, 49.0)}  # ratios 1.0, 0.98, 1.0204
    for rnd in range(3):
        for spec, label in runner.schedule(rnd).items():
            name = label.split("/")[1].split(" round")[0]
            runner.results[(spec, rnd)] = _fake_run(label, sps[name][rnd])
    a, b = rows_r(runner)
    assert a["ratio"] == pytest.approx(0.0) and a["ok"] and a["target"] == "<= 0.005"
    assert b["ratio"] == pytest.approx(0.0) and "every rank's pace on vs off" in b["metric"]


def test_case_j_turns_the_journal_off_only_and_reports_the_median_round_cost(tmp_path):
    """(j): "off" is the "on" run through bench/variants.py no-journal (RAY_APP_JOURNAL=0), nothing else
    changed; "on" is case (a)'s and (b)'s kit run; the row's ratio is 1 - the median per-round on / off ratio."""
    from bench.run import Plan, Runner, rows_j
    from bench.variants import VARIANTS

    assert VARIANTS["no-journal"][0] == {"RAY_APP_JOURNAL": "0"}
    for size in ("full", "smoke"):
        specs = Plan(size, ("kit",)).specs["j"]
        on, off = specs["a on"], specs["a off"]
        assert (off.overrides, off.workers, off.launch, off.storage) == (on.overrides, on.workers, on.launch, on.storage)
        assert (on.variant, off.variant, off.launch) == ("", "no-journal", "cold")
    plan = Plan("full", ("kit",))
    assert plan.specs["j"]["a on"] == plan.specs["a"]["kit"] and plan.specs["j"]["b on"] == plan.specs["b"]["kit"]
    runner = Runner(plan, ["j"], 3, tmp_path)
    sps = {"a on": (99.0, 98.0, 101.0), "a off": (100.0, 100.0, 100.0),  # ratios 0.99, 0.98, 1.01
           "b on": (50.0, 49.0, 50.0), "b off": (50.0, 50.0, 49.0)}  # ratios 1.0, 0.98, 1.0204
    for rnd in range(3):
        for spec, label in runner.schedule(rnd).items():
            name = label.split("/")[1].split(" round")[0]
            runner.results[(spec, rnd)] = _fake_run(label, sps[name][rnd])
    a, b = rows_j(runner)
    assert a["ratio"] == pytest.approx(0.01) and not a["ok"] and a["target"] == "<= 0.005"
    assert b["ratio"] == pytest.approx(0.0) and b["ok"] and "the run journal on vs off" in b["metric"]


def test_case_l_runs_one_language_model_workload_three_ways_and_reports_target_tokens_per_second(tmp_path):
    """(l): the kit, the twin and the kit's loop alone get the same --set values (a Hugging Face model under FSDP,
    text, causal_lm); each row is steady samples/s x the target tokens of a sequence (seq_len - 1), over the twin's."""
    from bench import lm
    from bench.run import Plan, Runner, rows_l

    for size in ("full", "smoke"):
        l_specs = Plan(size, ("kit",)).specs["l"]
        assert {s.kind for s in l_specs.values()} == {"kit", "twin", "loop"}
        assert len({s.overrides for s in l_specs.values()}) == 1
        kit = l_specs["kit"]
        assert (kit.value("model.name"), kit.value("task.name"), kit.value("data.name"),
                kit.value("train.strategy")) == ("hf", "causal_lm", "text", "fsdp")
        assert kit.value("model.args.path") == str(lm.folder(size) / "model")
        assert int(kit.value("data.args.seq_len")) - 1 == lm.target_tokens_per_sample(size)
    runner = Runner(Plan("full", ("kit",)), ["l"], 3, tmp_path)
    sps = {"kit": (90.0, 80.0, 85.0), "twin": (100.0, 100.0, 100.0), "loop": (99.0, 101.0, 100.0)}
    for rnd in range(3):
        for spec, label in runner.schedule(rnd).items():
            runner.results[(spec, rnd)] = _fake_run(label, sps[label.split("/")[1].split(" round")[0]][rnd])
    kit, loop, wall = rows_l(runner)
    assert (kit["kit"], kit["ref"], kit["ratio"]) == (85.0 * 127, 100.0 * 127, 0.85) and not kit["ok"]
    assert "per round 0.900, 0.800, 0.850" in kit["note"] and kit["target"] == ">= 0.97"
    assert (loop["kit"], loop["ratio"], loop["ok"], loop["target"]) == (100.0 * 127, 1.0, True, ">= 0.98")
    assert wall["ratio"] == 1.0


def test_case_m_gives_the_kit_and_the_twin_the_same_switches_and_reports_each_ranks_peak_memory(tmp_path):
    """(m): every switch off and each one on, the kit and the twin with the same --set values, memory sampled;
    rows: on / off of each side from the per-round ratios, kit / twin, each rank's peak (rank order) on / off."""
    from bench.measure import RankMemory
    from bench.run import SPEED_SWITCHES, Plan, Runner, rows_m

    specs = Plan("full", ("kit",)).specs["m"]
    for name, extra in {"off": (), **SPEED_SWITCHES}.items():
        kit, twin = specs[f"kit {name}"], specs[f"twin {name}"]
        assert kit.rank_memory and twin.rank_memory and (kit.kind, twin.kind) == ("kit", "twin")
        assert set(extra) <= set(kit.overrides)
        strip = [o for o in kit.overrides if not o.startswith("train.compile_cache_dir=")]
        assert strip == [o for o in twin.overrides if not o.startswith("train.compile_cache_dir=")]
    assert specs["kit compile"].value("train.compile_cache_dir") != specs["twin compile"].value("train.compile_cache_dir")
    runner = Runner(Plan("full", ("kit",)), ["m"], 2, tmp_path)
    sps = {"kit off": (100.0, 110.0), "twin off": (100.0, 100.0), "kit ac full": (60.0, 77.0),
           "twin ac full": (70.0, 70.0)}
    peaks = {"kit off": [900.0, 880.0], "kit ac full": [800.0, 790.0], "twin off": [700.0, 690.0],
             "twin ac full": [600.0, 610.0]}
    for rnd in range(2):
        for spec, label in runner.schedule(rnd).items():
            name = label.split("/")[1].split(" round")[0]
            run = _fake_run(label, sps.get(name, (50.0, 50.0))[rnd])
            run["rank_peak_mib"] = peaks.get(name, [500.0, 500.0])
            runner.results[(spec, rnd)] = run
    rows = {r["metric"].split(" (")[0]: r for r in rows_m(runner)}
    assert rows["ac full: kit on / off, steady samples/s"]["ratio"] == pytest.approx((0.6 + 0.7) / 2)
    assert rows["ac full: twin on / off, steady samples/s"]["ratio"] == pytest.approx(0.7)
    on_off = rows["ac full on: peak resident memory of a rank, kit on / off"]
    assert (on_off["kit"], on_off["ref"]) == (800.0, 900.0) and "800/790 vs 900/880" in on_off["note"]
    assert rows["ac full on: peak resident memory of a rank, kit / twin"]["note"] == "each rank: 800/790 vs 600/610"
    # a kit's ranks come from Ray Train's log ({pid: rank}); a warm cluster's other jobs' workers are left out
    memory = RankMemory(lambda: [])
    memory.peak_kib, memory.rank = {11: 2048, 12: 1024, 99: 4096}, {}
    assert memory.by_rank({12: 0, 11: 1}) == [1.0, 2.0]
    memory.rank = {99: 1, 11: 0}  # a twin's ranks say their rank
    assert memory.by_rank() == [2.0, 4.0, 1.0]
