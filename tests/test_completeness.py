"""Every registered patch is a complete unit (the idea of dd-trace-py's
``test_verify_test_coverage``): its folder ``patches/<name>/`` holds the
declaration, a reproduction (``scenario.py``) and the judge (``proof.py``) the
tests and ``zeroshim prove`` share; a patch whose failure prints an error has
real logs (``logs/*.log``) that ``zeroshim explain`` attributes to it and to no
other patch; its test is ``tests/test_<name>.py`` and uses that judge; the
README's generated block is current; CHANGELOG.md mentions it.

Adding a patch is one folder, one line in ``patches/__init__.py``, one test
file and one CHANGELOG line; this test names whichever is missing."""

import ast
import re
from pathlib import Path

import pytest

import zeroshim
from zeroshim import _docs, _launch

pytestmark = pytest.mark.once
REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
PATCHES = Path(_launch.patches_dir())  # the installed copy (the wheel must ship every piece)
NAMES = zeroshim.patch_names()


def test_the_registry_lists_every_folder_and_nothing_else():
    folders = sorted(p.parent.name for p in PATCHES.glob("*/__init__.py"))
    assert folders == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_folder_holds_declaration_scenario_and_proof(name):
    folder = PATCHES / name
    assert zeroshim.get_patch(name).name == name
    assert (folder / "scenario.py").is_file(), f"{name}: no reproduction (scenario.py)"
    proof = folder / "proof.py"
    assert proof.is_file(), f"{name}: no judge (proof.py)"
    defined = {n.name for n in ast.parse(proof.read_text()).body if isinstance(n, ast.FunctionDef)}
    assert {"judge", "prove"} <= defined, f"{name}/proof.py must define judge() and prove()"


@pytest.mark.parametrize("name", NAMES)
def test_docstring_has_every_section(name):
    parts = _docs.sections(zeroshim.get_patch(name).doc)
    missing = [s for s in ("Symptom", "Cause", "Affected versions", "Flag", "Fix", "Undo") if not parts.get(s)]
    assert not missing, f"{name}: docstring lacks {missing}"


def _mentions(text: str, version: str) -> bool:
    """``version`` ("0.19.4") appears in ``text`` as a whole version number; a wildcard ("5.1.*") as the
    start of one ("5.1", "5.1.0")."""
    head = version.removesuffix(".*")
    tail = r"(?!\d)" if version.endswith(".*") else r"(?!\.?\d)"
    return re.search(rf"(?<![\d.]){re.escape(head)}{tail}", text) is not None


@pytest.mark.parametrize("name", NAMES)
def test_affected_versions_state_the_bounds_of_affects(name):
    """A patch's range is written once, in ``affects``; the versions column (``Patch.versions``) is derived from
    it, and the docstring's "Affected versions" must state the same bounds: each version of the specifier
    appears there, and a package affected in every release is said to be ("every"/"any" and its name)."""
    from zeroshim import _versions

    patch = zeroshim.get_patch(name)
    text = _docs.sections(patch.doc)["Affected versions"]
    missing = []
    for package, spec in patch.affects.items():
        found = _versions.clauses(spec)
        if not found:
            shown = _versions.DISPLAY_NAMES.get(package, package)
            if not (re.search(r"\b(every|any)\b", text, re.I) and re.search(re.escape(shown), text, re.I)):
                missing.append(f"{package}: every release")
        missing += [f"{package} {op}{version}" for op, version in found
                    if not _mentions(text, version)]
    assert not missing, f"{name}: the docstring's Affected versions does not state {missing} (affects={patch.affects})"
    assert patch.versions == _versions.describe(patch.affects, patch.versions_note)


def test_test_modules_name_only_bounds_of_affects():
    """A test module's own range (``AFFECTED = ds_before("0.19.3") ...``, written from the tagged sources and
    compared with the gate on the installed stack by tests/test_inert_gates.py) may only name versions that are
    bounds of its patch's ``affects``: a bound moved in one place and not the other fails here, on any stack."""
    from conftest import patch_of
    from zeroshim import _versions

    for path in sorted(TESTS.glob("test_*.py")):
        name = patch_of(path.stem, NAMES)
        line = re.search(r"^AFFECTED\s*=(.*)$", path.read_text(), re.M)
        if name is None or line is None or "gate_verdict" in line.group(1):
            continue
        bounds = {v.removesuffix(".*") for spec in zeroshim.get_patch(name).affects.values()
                  for _, v in _versions.clauses(spec)}
        named = set(re.findall(r"\"(\d+(?:\.\d+)*)\"", line.group(1)))
        assert named <= bounds, f"{path.name}: AFFECTED names {sorted(named - bounds)}, not bounds of {name}'s affects"


@pytest.mark.parametrize("name", NAMES)
def test_its_test_file_uses_the_shared_judge(name):
    test = TESTS / f"test_{name}.py"
    assert test.is_file(), f"{name}: no tests/test_{name}.py"
    assert re.search(rf"load_proof\(\s*\"{name}\"\s*\)", test.read_text()), \
        f"tests/test_{name}.py does not run the judge of patches/{name}/proof.py"


def _matching(text: str) -> set:
    from zeroshim import _cli

    return {f["patch"] for f in _cli.explain_text(text)}


@pytest.mark.parametrize("name", NAMES)
def test_real_logs_match_its_own_signatures_and_no_other(name):
    patch = zeroshim.get_patch(name)
    logs = sorted((PATCHES / name / "logs").glob("*.log"))
    if not patch.signatures:
        assert not logs, f"{name} has logs but no signature to match them"
        return  # a silent failure (wrong numbers, a hang, memory): nothing printed to recognise
    assert logs, f"{name} declares error signatures but ships no real log (patches/{name}/logs/*.log)"
    for log in logs:
        assert _matching(log.read_text(errors="replace")) == {name}, log.name


@pytest.mark.parametrize("name", NAMES)
def test_changelog_mentions_it(name):
    assert f"`{name}`" in (REPO / "CHANGELOG.md").read_text(), f"CHANGELOG.md never mentions `{name}`"


def test_readme_block_is_generated_from_the_declarations():
    readme = (REPO / "README.md").read_text()
    assert _docs.replace_block(readme, _docs.render()) == readme, \
        "README.md's patch block is stale: run `python -m zeroshim._docs README.md`"
    for name in NAMES:
        assert f"| [`{name}`](docs/patches/{name}.md) |" in readme


def test_each_patch_page_is_generated_from_its_declaration():
    """docs/patches/<name>.md and its index are what zeroshim._docs produces now, and nothing else is there."""
    folder = REPO / _docs.PAGES
    wanted = _docs.pages()
    assert sorted(p.name for p in folder.glob("*")) == sorted(wanted), "run `python -m zeroshim._docs README.md`"
    for file, text in wanted.items():
        assert (folder / file).read_text() == text, f"{file} is stale: run `python -m zeroshim._docs README.md`"


def test_the_index_of_targets_is_generated_from_the_declarations():
    """patches/_targets.py (what ``import zeroshim`` hooks, without importing the patches) is what zeroshim._docs
    produces now, and names the same targets as each declaration."""
    assert (REPO / _docs.INDEX).read_text() == _docs.render_targets(), \
        f"{_docs.INDEX} is stale: run `python -m zeroshim._docs README.md`"


def _noxfile_literal(name: str):
    """A module-level literal of noxfile.py (read, not imported: nox need not be installed here)."""
    tree = ast.parse((REPO / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"noxfile.py has no {name} = <literal>")


def test_newest_tested_is_the_newest_pin_of_the_ci_matrix():
    """doctor's "newer than the newest tested" (zeroshim._versions.NEWEST_TESTED) states the matrix's newest
    pins, which live in noxfile.py: the two may not drift."""
    from packaging.version import Version

    from zeroshim import _versions

    matrix, torch_of = _noxfile_literal("MATRIX"), _noxfile_literal("TORCH_OF")
    pins = {"torch": [_noxfile_literal("TORCH_DEFAULT")] + [v for k, v in torch_of.items() if k in matrix]}
    for packages in matrix.values():
        for spec in packages:
            name, _, version = spec.partition("==")
            if name in ("deepspeed", "transformers") and version:
                pins.setdefault(name, []).append(spec)
    newest = {}
    for name, specs in pins.items():
        versions = [s.partition("==")[2].removesuffix(".*") for s in specs]
        newest[name] = max(versions, key=Version)
    assert newest == _versions.NEWEST_TESTED


# -- where each patch's launches run (issue #43): derived from its declaration ----------------------------------------

HAND_LISTS = ("ENVS", "INERT_ENVS", "ONE_RANK_ENVS")


def test_where_launches_run_is_derived_not_listed():
    """tests/conftest.py ``placement`` decides from each patch's gate where its launch tests run; a module that
    proves a patch keeps no list of environments.  Only modules that prove no one patch (the differential
    sample, the multi-node runners) name theirs (``ENVS``), with the reason, and only environments that exist."""
    from conftest import patch_of

    matrix = _noxfile_literal("MATRIX")
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        assigned = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                    if isinstance(t, ast.Name)}
        lists = assigned & set(HAND_LISTS)
        if patch_of(path.stem, NAMES) is not None:
            assert not lists, f"{path.name} proves a patch and lists environments ({sorted(lists)}): remove them"
        elif "ENVS" in assigned:
            assert "ENVS_REASON" in assigned, f"{path.name} names its environments without ENVS_REASON"
            module = __import__(path.stem)
            assert set(module.ENVS) <= set(matrix), (path.name, module.ENVS)


def test_the_newest_environment_holds_the_newest_stack():
    """Every patch's launches run in NEWEST_ENV (tests/conftest.py): it must hold the matrix's newest DeepSpeed,
    transformers and torch (zeroshim._versions.NEWEST_TESTED, checked against the pins above)."""
    from harness import NEWEST_ENV
    from zeroshim import _versions

    matrix, torch_of = _noxfile_literal("MATRIX"), _noxfile_literal("TORCH_OF")
    pins = dict(spec.partition("==")[::2] for spec in matrix[NEWEST_ENV])
    held = {"deepspeed": pins["deepspeed"], "transformers": pins["transformers"].removesuffix(".*"),
            "torch": torch_of.get(NEWEST_ENV, _noxfile_literal("TORCH_DEFAULT")).partition("==")[2]}
    assert held == _versions.NEWEST_TESTED, (NEWEST_ENV, held)


def test_light_environments_prove_what_no_full_environment_shows():
    """A light environment (noxfile.py LIGHT) runs the tests of the patches no full environment shows: derived
    (tests/conftest.py light_patches), here with every gate taken as affected on the light stack."""
    from conftest import light_patches, pins_hold

    light, matrix, torch_of = (_noxfile_literal(k) for k in ("LIGHT", "MATRIX", "TORCH_OF"))
    full = {}
    for env, specs in matrix.items():
        if env not in light:
            full[env] = {spec.partition("==")[0]: spec.partition("==")[2] for spec in specs if "==" in spec}
            full[env]["torch"] = torch_of.get(env, _noxfile_literal("TORCH_DEFAULT")).partition("==")[2]
    assert light and all(env in matrix for env in light), light
    patches = [zeroshim.get_patch(name) for name in NAMES]
    here = {spec.partition("==")[0]: spec.partition("==")[2] for spec in matrix["tf5.0.0"] if "==" in spec}
    chosen = light_patches(patches, full, verdict=lambda patch: (True, "taken as affected"), here=here)
    # zero3_from_config_init's range (4.52-5.2) holds in ds0.19.2 too, but on transformers 4: 5.0 runs its 5.x form
    assert {"zero3_conversion_dropped_keys", "zero3_from_config_init"} <= set(chosen), chosen
    for name in ("nonreentrant_checkpoint", "zero3_unwrapped_model", "trainer_max_grad_norm"):
        assert name not in chosen and any(pins_hold(zeroshim.get_patch(name), pins) for pins in full.values())
    for name in chosen:
        assert (TESTS / f"test_{name}.py").exists(), name