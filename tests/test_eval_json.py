"""`miniapp eval json`: constrained answers to the bundled JSON schemas, their validity and
what the constraint costs, as one JSON object."""

from __future__ import annotations

import json
import subprocess

import jsonschema

from miniapp.engine.evaluation.json_validity import schema_cases


def test_eval_json_reports_consistent_counts_and_costs(miniapp_exe):
    done = subprocess.run(
        [miniapp_exe, "eval", "json", "--limit", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    cases = schema_cases(3)
    schemas = report["schemas"]
    assert report["total"] == 3 and [s["name"] for s in schemas] == [c.name for c in cases]
    assert 0 <= report["valid"] <= report["parsed"] <= report["total"]
    for key in ("finished", "parsed", "valid"):
        assert report[key] == sum(s[key] for s in schemas), key
    cut = sum(s["constrained"]["reason"] == "max_tokens" for s in schemas)
    assert report["cut_by_max_tokens"] == cut and report["finished"] + cut <= 3
    for schema, case in zip(schemas, cases, strict=True):
        answer = schema["constrained"]
        assert 0 < answer["generated_tokens"] <= report["max_tokens"] == 384
        # The reported verdict is the jsonschema package's own, on the text shown.
        try:
            jsonschema.validate(
                json.loads(answer["text"]), case.schema, cls=jsonschema.Draft202012Validator
            )
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
        assert schema["valid"] is valid, (case.name, answer["text"], schema["problem"])
        # A constrained answer that ended its turn holds a complete value of the schema.
        if schema["finished"]:
            assert schema["valid"], (case.name, answer["text"], schema["problem"])
        assert schema["compile_s"] > 0 and (schema["mask_median_s"] or 1) > 0
        assert "text" not in schema["free"] and schema["free"]["generated_tokens"] > 0
    # A greedy step checks the model's best token, and masks only when the schema refuses
    # it: a check or a mask per token at least (more when verification checks drafts). The
    # model's first choice is prose or a code fence, never the value, so masks happen.
    tokens = sum(s["constrained"]["generated_tokens"] for s in schemas)
    assert report["mask_calls"] + report["check_calls"] >= tokens
    assert 0 < report["mask_calls"] < tokens and 0 < report["check_median_s"]
    assert 0 < report["mask_median_s"] <= report["mask_p90_s"]
    assert report["mask_median_s"] <= report["whole_mask_median_s"]
    assert 0 < report["mask_share"] < 1
    assert report["tokenizer_build_s"] > 0
    assert 0 < report["compile_median_s"] <= report["compile_max_s"]
    assert report["decode_tok_s"] > 0 and report["free_decode_tok_s"] > 0
    ratio = report["decode_tok_s"] / report["free_decode_tok_s"]
    assert abs(report["ratio"] - ratio) < 1e-9
    assert report["spec"] == "auto" and report["backend"] == "torch"


def test_eval_json_with_a_bad_model_is_one_line_and_exit_2(miniapp_exe, tmp_path):
    missing = tmp_path / "missing.gguf"
    done = subprocess.run(
        [miniapp_exe, "eval", "json", "--model", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"miniapp: error: {missing}: file not found"]
