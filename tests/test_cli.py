"""The ``ensemble`` command: argument parsing (fast) and generate on the bundled pair (real); the demo: test_demo.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ensemble_core.cli import build_parser, generate_config, main
from ensemble_core.errors import InvalidOptionError
from ensemble_core.flags import member_options, parse_sets, parse_value


def test_parse_value_and_sets() -> None:
    assert parse_value("3") == 3 and parse_value("0.5") == 0.5 and parse_value("true") is True
    assert parse_value("None") is None and parse_value("gac") == "gac" and parse_value('["a", "b"]') == ["a", "b"]
    sets = parse_sets(["lookahead=4", "specem.segment-length=8", "stop=[\"\\n\\n\"]"])
    assert sets == {"*": {"lookahead": 4, "stop": ("\n\n",)}, "specem": {"segment_length": 8}}
    with pytest.raises(InvalidOptionError):
        parse_sets(["lookahead"])


def test_generate_config_and_member_options() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--method", "specem", "--segment-length", "6",
                                      "--set", "hedge=false", "--max-new-tokens", "9", "--stop", "###"])
    assert generate_config(args) == {"hedge": False, "max_new_tokens": 9, "segment_length": 6, "stop": ("###",)}
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--device", "cuda:0", "cuda:1", "--dtype", "bfloat16"])
    assert member_options(args, 2) == [{"dtype": "bfloat16", "device": "cuda:0"}, {"dtype": "bfloat16", "device": "cuda:1"}]
    with pytest.raises(InvalidOptionError):
        member_options(args, 3)
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--quantize", "none", "int8"])
    assert member_options(args, 2) == [{"dtype": "auto", "quantize": None}, {"dtype": "auto", "quantize": "int8"}]
    with pytest.raises(InvalidOptionError, match="--quantize"):
        member_options(args, 3)
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--dtype", "float32", "bfloat16"])
    assert member_options(args, 2) == [{"dtype": "float32"}, {"dtype": "bfloat16"}]  # a float32 drafter, a bf16 verifier
    with pytest.raises(InvalidOptionError, match="--dtype"):
        member_options(args, 3)
    args = build_parser().parse_args(["bench"])
    assert args.max_new_tokens == 256 and args.dataset == "gsm8k" and len(args.methods) == 5


def test_bad_input_exits_2_with_a_clear_message_before_loading(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "chat.json"
    bad.write_text("not json", encoding="utf-8")
    assert main(["generate", "--chat-file", str(bad)]) == 2
    assert "is not JSON" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--lookahead", "0"]) == 2
    assert "Invalid value for 'lookahead'" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--set", "segmnt_length=3"]) == 2
    assert "segmnt_length" in capsys.readouterr().err
    # --set reaches --throughput's options (it was dropped there): checked before any member loads
    assert main(["bench", "--throughput", "--methods", "safe", "--set", "safe.prompt_lookup=-1",
                 "--out", str(tmp_path / "throughput")]) == 2
    assert "prompt_lookup" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate"])  # argparse: --prompt or --chat-file is required


@pytest.mark.real
def test_generate_plain_stream_and_chat_file(tmp_path: Path, capsys) -> None:
    assert main(["generate", "--method", "safe", "--max-new-tokens", "8", "--prompt", "What is 2 + 2?", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["completion_tokens"] <= 8 + 4 and result["stats"]["method"] == "safe"
    assert "\n".join(lines[:-1]) == result["text"]

    chat = tmp_path / "messages.json"
    chat.write_text(json.dumps([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Name a colour."}]), encoding="utf-8")
    assert main(["generate", "--method", "specem", "--segment-length", "4", "--max-new-tokens", "8",
                 "--chat-file", str(chat), "--stream", "--quiet"]) == 0
    streamed = capsys.readouterr().out
    assert streamed.strip() and "\ufffd" not in streamed
