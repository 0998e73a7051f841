"""Every command the README and docs/ show is checked here, cheaply, and the README's ``fit()`` example runs.

A command is a line of a fenced shell block (no language, or ``sh``: :data:`tools.doc_markers.SHELL`) of README.md
or docs/*.md, or inline code of the README that starts with a program (:data:`PROGRAMS`). A block marked
``<!-- illustrative: WHY -->`` (a synopsis with placeholders, a config of the reader's own) is not checked, and says
why; a block that is no command has a language (``text`` for output). A ``functrain`` line parses with the CLI's own
parser; the repository paths it names exist, the configs it names load (validated, nothing run) and the run
directories it reads are ones a documented command makes. A ``make`` line names a Makefile target, and the
``functrain`` line its recipe runs (with the line's variables) passes the same checks. An install line installs
extras pyproject.toml declares (``pip``) or a script the repository holds (``sh``). Inline code of the README naming
a verb or a flag (`functrain eval`, `--search`) names one the CLI has, and the modules the layout table names are
there. The Python example runs for real: 5 steps into a temporary run directory, its summary's lines of the kinds
the README's sample shows. An inline command none of this applies to is listed in :data:`NOT_CHECKED` with the
reason. docs/cli.md's synopsis (illustrative) names every verb and flag the CLI has, and no other.
"""

import argparse
import functools
import logging
import re
import shlex
from importlib.metadata import metadata
from logging.handlers import BufferingHandler
from pathlib import Path

import pytest

from functrain.callbacks.outcome import StopKind
from functrain.commands import cli
from functrain.config.load import load_config
from functrain.config.schema import RunSections
from functrain.report.console import RUN_LOGGER
from tools import doc_markers

ROOT = doc_markers.ROOT
README = (ROOT / "README.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
INLINE = re.compile(r"`([^`]+)`")
PROGRAMS = ("functrain", "make", "sh", "pip", ".venv/bin/pip", ".")
# Inline commands of the README no check applies to, and why.
NOT_CHECKED = {
    ". .venv/bin/activate": "puts the .venv/ `make` creates on the shell's PATH: the shell's state, nothing to check",
}
# Folders of the repository a command's path may name (anything else, such as runs/, is made by the commands).
REPO_FOLDERS = ("configs", "examples", "tools", "docs", "bench")


def fenced_blocks(path: Path = ROOT / "README.md") -> list[doc_markers.FencedBlock]:
    """The fenced blocks of a document (the README by default)."""
    return doc_markers.fenced_blocks(path.read_text())


def _split(line: str) -> list[list[str]]:
    """A shell line as the words of its commands: comments dropped, split at ``&&``."""
    commands: list[list[str]] = [[]]
    for word in shlex.split(line, comments=True):
        if word == "&&":
            commands.append([])
        else:
            commands[-1].append(word)
    return [words for words in commands if words]


def block_commands(path: Path = ROOT / "README.md") -> list[list[str]]:
    """The commands of a document's checked shell blocks (continued lines joined)."""
    commands = []
    for block in fenced_blocks(path):
        if block.checked:
            for line in block.body.replace("\\\n", " ").splitlines():
                commands += _split(line)
    return commands


def inline_spans() -> list[str]:
    """Inline code of the prose (a span broken over lines joined), fenced blocks left out."""
    return [span.replace("\n", " ") for span in INLINE.findall(doc_markers.FENCE.sub("", README))]


def inline_commands() -> list[list[str]]:
    """Inline code that is a command: a program and at least one word."""
    return [shlex.split(span) for span in inline_spans() if span.split()[0] in PROGRAMS and len(span.split()) > 1]


def readme_commands() -> list[list[str]]:
    """Every command of the README, once each, in the README's order (fenced blocks first)."""
    unique = dict.fromkeys(tuple(words) for words in [*block_commands(), *inline_commands()])
    return [list(words) for words in unique]


def documented_commands() -> list[list[str]]:
    """Every command of the README and docs/, once each: the README's, then the docs' fenced blocks'."""
    docs = [words for path in doc_markers.documents()[1:] for words in block_commands(path)]
    unique = dict.fromkeys(tuple(words) for words in [*readme_commands(), *docs])
    return [list(words) for words in unique]


# ------------------------------------------------------------------------------------------------ make


def make_variables() -> dict[str, str]:
    """The Makefile's variables and their defaults (``CONFIG ?= ...``, ``VENV := ...``)."""
    return dict(re.findall(r"^(\w+) *[?:]?= *(.*?) *$", MAKEFILE, re.M))


def make_targets() -> set[str]:
    """The Makefile's targets."""
    return {target for line in re.findall(r"^([^\s#=]+):", MAKEFILE, re.M) for target in line.split()}


def make_recipe_functrain(words: list[str]) -> list[list[str]]:
    """The ``functrain`` lines the recipe of ``make TARGET VAR=value...`` runs, its variables substituted."""
    target, variables = words[1], {**make_variables(), **dict(word.split("=", 1) for word in words[2:])}
    recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)*)", MAKEFILE, re.M)  # None: no target (its test says)
    lines = []
    for line in recipe.group(1).splitlines() if recipe else []:
        if line.strip().startswith("$(VENV)/bin/functrain "):
            line = re.sub(r"\$\((\w+)\)", lambda match: variables[match.group(1)], line.strip())
            lines.append(["functrain", *shlex.split(line)[1:]])
    return lines


# ------------------------------------------------------------------------------------------------ functrain


@functools.cache
def verb_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each verb's parser, as ``functrain`` builds them."""
    parser = cli._parser()
    return next(action.choices for action in parser._actions if isinstance(action, argparse._SubParsersAction))


def options_of(parser: argparse.ArgumentParser) -> set[tuple[str, ...]]:
    """A parser's options, each as its option strings (``("-o", "--output")``), its subcommands' included
    (``convert functrain-to-hf --step``), help left out."""
    options = {tuple(action.option_strings) for action in parser._actions if action.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            options |= {option for sub in action.choices.values() for option in options_of(sub)}
    return options - {("-h", "--help")}


def parsed(words: list[str]) -> argparse.Namespace:
    """``functrain ...`` parsed as the CLI parses it (trailing ``key=value`` words of some verbs: overrides)."""
    try:
        args, extra = cli._parser().parse_known_args(words[1:])
    except SystemExit:
        pytest.fail(f"the README's `{shlex.join(words)}` does not parse (argparse's message above)")
    if args.command in cli.TAKES_OVERRIDES and all("=" in word and not word.startswith("-") for word in extra):
        args.overrides += extra
    else:
        assert not extra, f"the README's `{shlex.join(words)}`: unrecognized arguments {extra}"
    return args


def mentions_a_verb(words: list[str]) -> bool:
    """``functrain VERB [--flag ...]``: prose naming a verb (and flags), not a command to run."""
    return words[1] in cli.VERBS and all(word.startswith("--") for word in words[2:])


def functrain_lines() -> list[list[str]]:
    """Every ``functrain`` line the README and docs run, their own and those of the ``make`` targets they run."""
    lines = []
    for words in documented_commands():
        if words[0] == "functrain":
            lines.append(words)
        elif words[0] == "make":
            lines += make_recipe_functrain(words)
    return lines


@functools.cache
def trained_runs() -> dict[str, str]:
    """``run.dir`` -> the config of each run a documented command trains (a config that is not there: none; the
    command's own test says so)."""
    runs = {}
    for words in functrain_lines():
        args = parsed(words) if words[1] == "train" else None
        if args is not None and (ROOT / args.config).is_file():
            runs[load_config(ROOT / args.config, args.overrides).run.dir] = args.config
    return runs


@functools.cache
def made_runs() -> set[str]:
    """The run directories documented commands make: those they train, convert into or tokenize into."""
    made = set(trained_runs())
    for words in functrain_lines():
        if mentions_a_verb(words):
            continue
        args = parsed(words)
        if args.command == "convert" and args.direction == "hf-to-functrain":
            made.add(args.run_dir)
        elif args.command == "tokenize":
            made.add(args.out)
    return made


def _strings(tree: object) -> list[str]:
    if isinstance(tree, dict):
        return [text for value in tree.values() for text in _strings(value)]
    if isinstance(tree, (list, tuple)):
        return [text for value in tree for text in _strings(value)]
    return [tree] if isinstance(tree, str) else []


def check_paths(words: list[str], args: argparse.Namespace, runs: set[str]) -> None:
    """The repository paths a parsed ``functrain`` line names exist, its configs load, the runs it reads are made
    by documented commands (``runs``)."""
    line = shlex.join(words)
    for value in _strings(vars(args)):
        if value.split("/")[0] in REPO_FOLDERS:
            assert (ROOT / value).exists(), f"the documented `{line}` names {value}, which is not there"
        if value.startswith("configs/") and value.endswith(".yaml"):
            load_config(ROOT / value, getattr(args, "overrides", []))
        if value.startswith("runs/") and value not in made_by(args):
            run = "/".join(value.split("/")[:2])
            assert run in runs, f"the documented `{line}` reads {run}, which no documented command makes"
    if args.command == "eval" and args.include_path:  # the tasks it names are defined in the folder it adds
        yamls = "".join(path.read_text() for path in (ROOT / args.include_path).rglob("*.yaml"))
        undefined = set(args.tasks.split(",")) - set(re.findall(r"^task: *(\S+)", yamls, re.M))
        assert not undefined, f"the documented `{line}`: {args.include_path} defines no {sorted(undefined)}"


def made_by(args: argparse.Namespace) -> set[str]:
    """What a parsed ``functrain`` line writes that is named on it (it reads none of that)."""
    if args.command == "convert":
        return {args.run_dir if args.direction == "hf-to-functrain" else args.out_dir}
    if args.command == "tokenize":
        return {args.out}
    if args.command == "eval" and args.output:
        return {args.output}
    return set()


# ------------------------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("words", documented_commands(), ids=shlex.join)
def test_a_documented_command_is_well_formed(words):
    program, line = words[0], shlex.join(words)
    if line in NOT_CHECKED:
        return
    if program == "functrain":
        if mentions_a_verb(words):
            options = verb_parsers()[words[1]]._option_string_actions
            assert all(word in options for word in words[2:]), f"`{line}`: functrain {words[1]} has no such flag"
            return
        placeholders = [word for word in words if re.fullmatch(r"[A-Z][A-Z0-9_]*(\.\w+)?", word)]
        assert not placeholders, f"`{line}` holds {placeholders}: mark its block <!-- illustrative: why -->"
        check_paths(words, parsed(words), made_runs())
    elif program == "make":
        assert words[1] in make_targets(), f"`{line}`: the Makefile has no target {words[1]!r}"
        unread = {word.split("=")[0] for word in words[2:]} - set(make_variables())
        assert not unread, f"`{line}` sets {sorted(unread)}, which the Makefile does not read"
        for recipe_line in make_recipe_functrain(words):
            check_paths(recipe_line, parsed(recipe_line), made_runs())
    elif program in ("pip", ".venv/bin/pip"):
        wanted = [re.fullmatch(r"(?:functrain|\.)\[(.+)\]", word) for word in words[2:]]
        extras = {extra for match in wanted if match for extra in match.group(1).split(",")}
        assert words[1] == "install" and extras, f"`{line}`: not a pip install of functrain's extras"
        assert extras <= set(metadata("functrain").get_all("Provides-Extra")), f"`{line}`: extras pyproject lacks"
    elif program == "sh":
        assert (ROOT / words[1]).is_file(), f"`{line}`: no script {words[1]} in the repository"
    else:
        pytest.fail(f"`{line}`: no check for {program!r} here; add one, or list it in NOT_CHECKED with the reason")


def test_the_runs_the_docs_train_start_from_runs_they_make():
    runs = trained_runs()
    assert {"runs/char_gpt", "runs/dpo_char_gpt", "runs/grpo_char_gpt", "runs/distill_char_gpt"} <= set(runs)
    for run_dir, config in runs.items():
        read = [value for value in _strings(load_config(ROOT / config).to_dict()) if value.startswith("runs/")]
        for value in read:
            assert value == run_dir or value in made_runs() or value in make_targets(), (
                f"{config} (trained by the docs) reads {value}, which no documented command or make target makes"
            )


def test_flags_the_readme_names_are_the_cli_s():
    flags = [span.split()[0] for span in inline_spans() if span.startswith("--")]
    options = {option for parser in verb_parsers().values() for option in parser._option_string_actions}
    unknown = sorted(set(flags) - options)
    assert flags and not unknown, f"the README names flags no functrain verb has: {unknown}"


def test_every_block_is_commands_or_says_what_it_is_and_the_lists_here_are_the_docs():
    readme = [block.language for block in fenced_blocks()]
    assert sorted(set(readme)) == ["", "python", "text"] and readme.count("python") == 1
    for path in doc_markers.documents():
        for block in fenced_blocks(path):
            assert block.language in (*doc_markers.SHELL, "text", "python", "yaml", "toml", "json"), (path, block)
            assert block.illustrative is None or block.language in doc_markers.SHELL, (path, block)
    commands = [shlex.join(words) for words in readme_commands()]
    assert set(NOT_CHECKED) <= set(commands)
    assert sum(words[0] == "functrain" for words in readme_commands()) >= 8
    assert len(documented_commands()) > len(readme_commands()) + 10  # the docs' own


def test_the_cli_synopsis_names_every_verb_and_flag_and_no_other():
    (synopsis,) = [block.body for block in fenced_blocks(ROOT / "docs" / "cli.md") if block.illustrative]
    texts: dict[str, str] = {}  # verb -> its lines (a line that does not start with functrain continues one)
    for line in synopsis.splitlines():
        verb = line.split()[1] if line.startswith("functrain ") else verb
        texts[verb] = texts.get(verb, "") + " " + line.split("#")[0]
    assert list(texts) == list(cli.VERBS)
    for verb, text in texts.items():
        named = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", text))
        options = options_of(verb_parsers()[verb])
        unnamed = [option for option in options if not named & set(option)]
        unknown = named - {string for option in options for string in option}
        assert not unnamed and not unknown, f"docs/cli.md's synopsis of {verb}: lacks {unnamed}, names {unknown}"
    cli_md = (ROOT / "docs" / "cli.md").read_text()
    assert sorted(re.findall(r"^## ([\w-]+)$", cli_md, re.M)[1:]) == sorted(cli.VERBS)  # a section each, after Errors
    overrides = re.search(r"^(.*) take trailing `dotted.key=value` config overrides", cli_md, re.M).group(1)
    assert re.findall(r"`([\w-]+)`", overrides) == list(cli.TAKES_OVERRIDES)


def test_the_modules_the_readme_layout_names_are_there():
    rows = re.findall(r"^\| `((?:functrain|torch_bridge)/[\w/]*)` \| (.*) \|$", README, re.M)
    assert len(rows) >= 10
    for folder, text in rows:
        while re.search(r"\([^()]*\)", text):  # what a parenthesis says of a module names no module
            text = re.sub(r"\([^()]*\)", "", text)
        for name in re.findall(r"`([\w/]+)`", text):
            path = ROOT / folder / name
            assert path.with_suffix(".py").is_file() or path.is_dir(), f"the README's layout names {folder}{name}"


def test_the_readme_links_every_page_of_the_docs_and_names_every_config_section():
    documentation = README.split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    linked = re.findall(r"^- \[docs/([\w-]+\.md)\]\(docs/\1\)", documentation, re.M)
    assert sorted(linked) == sorted(path.name for path in (ROOT / "docs").glob("*.md")) and len(set(linked)) == len(linked)
    row = next(line for line in README.splitlines() if line.startswith("| `functrain/config/` |"))
    named = re.search(r"`sections` \(([^)]*)\)", row).group(1).split(", ")
    in_sections = [name for name, field in RunSections.model_fields.items()
                   if getattr(field.annotation, "__module__", None) == "functrain.config.sections"]
    assert named == in_sections, "the README's layout: the sections functrain/config/sections.py defines"


def _anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_reach_their_pages_and_headings():
    """One page per topic: a page that states another's rule links to it, so its links must hold."""
    broken = []
    for path in doc_markers.documents():
        for target in re.findall(r"\]\(([^)\s]+)\)", doc_markers.FENCE.sub("", path.read_text())):
            if re.match(r"\w+://", target):
                continue  # a web page
            page, _, anchor = target.partition("#")
            destination = path.parent / page if page else path
            if not destination.exists():
                broken.append(f"{path.name}: {target}")
            elif anchor and destination.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", doc_markers.FENCE.sub("", destination.read_text()), re.M)
                if anchor not in {_anchor(heading) for heading in headings}:
                    broken.append(f"{path.name}: {target}")
    assert broken == []


def _kinds(lines: list[str]) -> list[str]:
    """What each line of a run summary reports: its leading words, paths left out (``summary of``, ``eval loss``,
    ``goodput``, ``lost``); the samples' text (``| ...``) is no kind of line."""
    unpathed = [re.sub(r"\S*/\S*", "", line).strip() for line in lines if not line.strip().startswith("|")]
    return [re.match(r"[a-z ]*", line).group().strip() for line in unpathed]


def test_the_readme_fit_example_runs_and_prints_the_summary_lines_the_readme_shows(tmp_path):
    (code,) = [block.body for block in fenced_blocks() if block.language == "python"]
    run_dir = tmp_path / "mlp_demo"
    for old, new in {'"runs/mlp_demo"': repr(str(run_dir)), '"max_steps": 300': '"max_steps": 5'}.items():
        assert code.count(old) == 1, f"the README's fit example no longer holds {old}: update this test's edit"
        code = code.replace(old, new)
    run_log, lines = logging.getLogger(RUN_LOGGER), BufferingHandler(capacity=10**6)
    level = run_log.level
    run_log.addHandler(lines)
    run_log.setLevel(logging.INFO)
    try:
        namespace: dict = {"__name__": "readme_fit_example"}
        exec(compile(code, "README.md's fit example", "exec"), namespace)
    finally:
        run_log.removeHandler(lines)
        run_log.setLevel(level)
    result = namespace["result"]
    assert (result.step, result.stop_kind, result.steps_run) == (5, StopKind.FINISHED, 5)
    assert Path(result.run_dir) == run_dir and (run_dir / "metrics.jsonl").exists()
    # Every kind of line this run's summary printed is in the README's sample of one (a goodput line added to the
    # summary and not to the sample fails here).
    summary = next(record.getMessage() for record in lines.buffer if record.getMessage().startswith("summary of"))
    (sample,) = [block.body for block in fenced_blocks() if block.body.startswith("summary of")]
    assert set(_kinds(summary.splitlines())) <= set(_kinds(sample.splitlines())), summary
