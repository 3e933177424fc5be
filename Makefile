# make docs        build the documentation site into docs/_build/html (offline, warnings are errors)
# make docs-small  the same with the gallery examples at reduced size (what CI's test builds)
# make docs-serve  serve docs/_build/html on http://127.0.0.1:8000
PYTHON ?= .venv/bin/python
SPHINXOPTS ?= -W --keep-going -q

.PHONY: docs docs-small docs-serve docs-clean

docs:
	$(PYTHON) -m sphinx -b html $(SPHINXOPTS) -d docs/_build/doctrees docs docs/_build/html
	@echo "docs: open docs/_build/html/index.html"

docs-small:
	FLASHOT_EXAMPLE_SMALL=1 $(MAKE) docs

docs-serve:
	$(PYTHON) -m http.server --bind 127.0.0.1 --directory docs/_build/html 8000

docs-clean:
	rm -rf docs/_build docs/auto_examples docs/sg_execution_times.rst
