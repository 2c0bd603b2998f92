"""`distlaunch run --config job.yaml`: options from a YAML file, command line overrides."""

import json

import yaml
from conftest import WORKERS, dl


def write(tmp_path, text):
    f = tmp_path / "job.yaml"
    f.write_text(text)
    return f


def test_job_file_runs_with_overrides(tmp_path):
    out = tmp_path / "env"
    out.mkdir()
    job = write(
        tmp_path,
        f"""# training job
nproc-per-node: 3
max_restarts: 2
env:
  FROM_FILE: "yes"
script: {WORKERS / "actor.py"}
args: [--dump-env, {out}]
""",
    )
    res = dl("run", "--config", job, "--max-restarts", "1")
    assert res.returncode == 0, res.stderr
    envs = [json.loads((out / f"{r}.json").read_text()) for r in range(3)]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["TORCHELASTIC_MAX_RESTARTS"] for e in envs} == {"1"}  # the command line wins
    assert {e["FROM_FILE"] for e in envs} == {"yes"}


def test_print_config_shows_merged_values(tmp_path):
    job = write(tmp_path, "nproc_per_node: 4\nstop_timeout: 5\nscript: train.py\nargs: [--lr, 0.1]\n")
    res = dl("run", "--config", job, "--stop-timeout", "7", "--print-config")
    assert res.returncode == 0, res.stderr
    merged = yaml.safe_load(res.stdout)
    assert merged["nproc_per_node"] == "4" and merged["stop_timeout"] == 7.0
    assert merged["script"] == "train.py" and merged["args"] == ["--lr", "0.1"]


def test_command_line_script_replaces_file_script(tmp_path):
    job = write(tmp_path, "script: does_not_exist.py\nnproc_per_node: 2\n")
    script = tmp_path / "s.py"
    script.write_text("import os; print('ok', os.environ['WORLD_SIZE'])\n")
    res = dl("run", "--config", job, script)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0]: ok 2", "[1]: ok 2"]


def error_line(res):
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_unknown_key_names_key_and_line(tmp_path):
    job = write(tmp_path, "nproc_per_node: 2\n\nmax_restart: 3\n")
    line = error_line(dl("run", "--config", job, "x.py"))
    assert f"{job}:3: max_restart: unknown option" in line


def test_wrong_type_names_key_and_line(tmp_path):
    job = write(tmp_path, "nproc_per_node: 2\nstop_timeout: soon\n")
    line = error_line(dl("run", "--config", job, "x.py"))
    assert f"{job}:2: stop_timeout" in line and "'soon'" in line
    job = write(tmp_path, "max_restarts: true\n")
    assert f"{job}:1: max_restarts" in error_line(dl("run", "--config", job, "x.py"))


def test_not_a_mapping_and_bad_yaml(tmp_path):
    job = write(tmp_path, "- a\n- b\n")
    assert "must be a mapping" in error_line(dl("run", "--config", job, "x.py"))
    job = write(tmp_path, "a: [1, 2\n")
    assert "not valid YAML" in error_line(dl("run", "--config", job, "x.py"))
    assert "cannot be read" in error_line(dl("run", "--config", tmp_path / "missing.yaml", "x.py"))
