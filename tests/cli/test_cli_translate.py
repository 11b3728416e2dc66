"""`encdec translate FILE... --to LANG [--from LANG]` on a random-init mBART-50: what it prints and writes
(the texts are noise; their shape is what counts), and the refusals before anything loads."""

from encdec_engine.cli.main import main


def test_translate_files_line_by_line(text_model, make_llm, tmp_path, capsys):
    path = text_model("mbart")
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("The rain in spain.\n\nThe council met on Monday.\n", encoding="utf-8")
    second.write_text("Größer Café\n", encoding="utf-8")
    args = ["--model", str(path), "--to", "de", "--from", "en", "--max-tokens", "4", "--quiet", "--threads", "2"]
    assert main(["translate", str(first), *args]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # three lines kept, the blank one blank
    expected = make_llm(path, num_kv_blocks=300).translate(["The rain in spain.", "The council met on Monday."],
                                                           "en", "de", max_tokens=4)
    assert [lines[0], lines[2]] == expected
    assert main(["translate", str(first), str(second), *args]) == 0
    out = capsys.readouterr().out
    assert out.count("== ") == 2 and f"== {second}" in out
    out_dir = tmp_path / "out"
    assert main(["translate", str(first), str(second), *args, "--output-dir", str(out_dir)]) == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["a.de.txt", "b.de.txt"]
    assert (out_dir / "a.de.txt").read_text(encoding="utf-8").split("\n")[0] == expected[0]


def test_translate_refusals(text_model, tmp_path, capsys):
    path = text_model("mbart")
    doc = tmp_path / "a.txt"
    doc.write_text("Hello\n", encoding="utf-8")
    assert main(["translate", str(tmp_path / "missing.txt"), "--model", str(path), "--to", "de"]) == 2
    assert "missing.txt" in capsys.readouterr().err
    assert main(["translate", str(doc), "--model", str(path), "--to", "tlh", "--quiet"]) == 2
    assert "'tlh' is not a language this mBART-50 model translates" in capsys.readouterr().err
    long = tmp_path / "long.txt"
    long.write_text("Hello\n\n" + "word " * 900 + "\n", encoding="utf-8")
    assert main(["translate", str(doc), str(long), "--model", str(path), "--to", "de", "--quiet"]) == 2
    err = capsys.readouterr().err  # the file and line, not "prompt 1" and a Python-only option
    assert err.startswith(f"error: {long}:3: ") and "this model's encoder takes at most" in err
