"""docs/models.md, the supported-models page, is what ``python tests/e2e/model_matrix.py``
writes from the matrix test's recorded outcomes (tests/e2e/model_matrix.json): every zoo
architecture is a row, every cell has an outcome, and every column names a test of the
matrix module that produces it."""

from __future__ import annotations

import ast

import yaml

from posttrain.testing.zoo import ARCHITECTURES
from tests.docs.pages import REPO
from tests.e2e import model_matrix as matrix


def test_the_page_is_written_from_the_recorded_outcomes():
    assert matrix.PAGE.read_text() == matrix.render(matrix.load()), "run: python tests/e2e/model_matrix.py"
    assert matrix.main(["--check"]) == 0


def test_every_zoo_architecture_is_a_row_and_every_cell_has_an_outcome():
    assert list(matrix.ROWS) == list(ARCHITECTURES)
    matrix.check_complete(matrix.load())


def test_every_column_is_a_test_of_the_matrix_module():
    tree = ast.parse((REPO / matrix.TEST_MODULE).read_text())
    tests = {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    assert {column.test for column in matrix.PATHS.values()} == tests


def test_a_cell_says_works_only_with_a_recorded_outcome(tmp_path):
    results = matrix.load()
    arch, path_id = next(iter(matrix.ROWS)), next(iter(matrix.PATHS))
    del results["cells"][arch][path_id]
    try:
        matrix.render(results)
    except ValueError as error:
        assert f"no outcome for {arch}/{path_id}" in str(error)
    else:
        raise AssertionError("a page was written with a cell nobody ran")


def test_the_page_is_in_the_sites_navigation():
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    assert {"Supported models": "models.md"} in nav


def test_the_default_run_checks_every_architecture_and_every_path():
    assert set(matrix.COVERING_CELLS) == set(matrix.PATHS)
    covered = {arch for archs in matrix.COVERING_CELLS.values() for arch in archs}
    assert covered == set(matrix.ROWS)
    assert matrix.cells_to_run("sft", full=True) == list(matrix.ROWS)


def test_every_vision_language_cell_that_works_names_a_test_that_runs_the_architecture():
    """A "works" cell's test exists, and its module names the architecture (its parametrization
    or the model it builds); the rows are the zoo's vision-language architectures."""
    from posttrain.testing.zoo import VISION_ARCHITECTURES

    assert list(matrix.VISION_ROWS) == list(VISION_ARCHITECTURES)
    assert set(matrix.VISION_CELLS) == set(matrix.VISION_PATHS)
    for path_id, column in matrix.VISION_PATHS.items():
        file, function = column.test.split("::")
        source = (REPO / file).read_text()
        tests = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
        assert function in tests, f"{path_id}: {column.test} does not exist"
        for arch in matrix.VISION_CELLS[path_id]:
            assert f'"{arch}"' in source or "ARCHITECTURES" in source, f"{path_id}: {file} never runs {arch}"
