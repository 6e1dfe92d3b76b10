"""The hvdp command's boundary: one table of commands, each a module with add_arguments and main(args);
--version, and bad options as one clear line and exit code 2."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import subprocess
import sys
import types
import typing
from pathlib import Path

import hvdp
from hvdp import cli

HVDP = [sys.executable, "-m", "hvdp.cli"]
NAMES = [name for name, _, _ in cli.COMMANDS]


def test_every_command_is_a_module_with_add_arguments_and_main():
    assert NAMES == ["run", "doctor", "report", "bench", "build"]
    contract = {"add_arguments": {"parser": argparse.ArgumentParser, "return": type(None)},
                "main": {"args": argparse.Namespace, "return": int}}
    for name, module_path, _ in cli.COMMANDS:
        module = importlib.import_module(module_path)
        for function_name, hints in contract.items():
            function = getattr(module, function_name)
            assert list(inspect.signature(function).parameters) == [p for p in hints if p != "return"], name
            assert typing.get_type_hints(function) == hints, (name, function_name)


def test_the_cli_dispatches_through_its_table_without_an_if_per_command():
    tree = ast.parse(Path(cli.__file__).read_text())
    compared = [node.value for compare in ast.walk(tree) if isinstance(compare, ast.Compare)
                for node in [compare.left, *compare.comparators] if isinstance(node, ast.Constant)]
    assert not set(compared) & set(NAMES)
    words = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in NAMES]
    assert sorted(words) == sorted(NAMES)  # each name once: in the table


def test_a_command_in_the_table_is_parsed_and_run_by_its_module(monkeypatch):
    seen = []
    module = types.ModuleType("fake_command")
    module.add_arguments = lambda parser: parser.add_argument("--n", type=int)
    module.main = lambda args: seen.append(args.n) or 7
    monkeypatch.setitem(sys.modules, "fake_command", module)
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, ("fake", "fake_command", "a command for the test")))
    assert cli.main(["fake", "--n", "3"]) == 7 and seen == [3]


def test_hvdp_run_hands_every_word_after_run_to_its_own_parser(monkeypatch):
    seen = []
    monkeypatch.setattr(importlib.import_module("hvdp.launch.run"), "run", lambda argv: seen.append(argv) or 0)
    argv = ["-np", "2", "--verbose", "--help", "--", "train.py", "-h", "--x=1"]
    assert cli.main(["run", *argv]) == 0 and seen == [argv]


def test_help_lists_every_command_and_importing_the_cli_imports_none():
    proc = subprocess.run([*HVDP, "--help"], capture_output=True, text=True, check=True)
    text = " ".join(proc.stdout.split())
    for name, _, help_line in cli.COMMANDS:
        assert f" {name} {help_line} " in text
    code = ("import sys, hvdp.cli\n"
            f"print(sorted(m for m in {[module for _, module, _ in cli.COMMANDS]!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_version_prints_the_package_version():
    proc = subprocess.run([*HVDP, "--version"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"hvdp {hvdp.__version__}"


def test_build_refuses_zero_jobs_in_one_line_without_starting():
    proc = subprocess.run([*HVDP, "build", "-j", "0"], capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("hvdp: error: --jobs 0 must be at least 1 (the number of parallel compile "
                                   "jobs); leave it out to use every core.")
    assert "Traceback" not in proc.stderr and proc.stdout == ""
