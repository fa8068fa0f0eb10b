"""The CLI: commands run, print their tables, write JSON, and turn bad input into one line."""

import json

import lowbit
from lowbit.cli import main


def test_formats_prints_every_format(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    for name in lowbit.FORMATS:
        assert name in out
    assert "SEEEEMMM" in out and "0 0.5 1 1.5 2 3 4 6" in out


def test_formats_error_table_and_json(tmp_path, capsys):
    path = tmp_path / "err.json"
    assert main(["formats", "--error", "--rows", "128", "--cols", "512", "--json", str(path)]) == 0
    rows = {r["scheme"]: r for r in json.loads(path.read_text())}
    # the lesson the table teaches: finer granularity and better formats cut the error
    assert rows["int4-tensor"]["rel_error"] > rows["int4-channel"]["rel_error"] > rows["int4-g128"]["rel_error"]
    assert rows["int4-g128"]["rel_error"] > rows["int4-g32"]["rel_error"]
    assert rows["nvfp4"]["sqnr_db"] > rows["mxfp4"]["sqnr_db"]
    assert rows["int8-channel"]["sqnr_db"] > rows["int8-tensor"]["sqnr_db"] + 10  # outliers ruin per-tensor int8
    assert "int4-g128" in capsys.readouterr().out


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert main(["formats", "--error", "--rows", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowbit formats: error:") and err.count("\n") == 1


def test_json_output_is_never_overwritten_without_force(tmp_path, capsys):
    path = tmp_path / "f.json"
    path.write_text("keep me")
    assert main(["formats", "--json", str(path)]) == 2
    assert path.read_text() == "keep me" and "--force" in capsys.readouterr().err
    assert main(["formats", "--json", str(path), "--force"]) == 0
    assert json.loads(path.read_text())[0]["name"] == "int2"


def test_unknown_recipe_is_refused_before_loading(capsys, tmp_path):
    assert main(["compare", "smollm2-135m", "--recipes", "fp8-dynamic,fp9", "--cache", str(tmp_path)]) == 2
    assert "unknown recipe 'fp9'" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()  # nothing was fetched or loaded
