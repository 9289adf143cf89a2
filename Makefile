# Crucible: set-up and tests. Everything heavy is cached under ~/.cache/crucible, not in the repo.
#   make demo    install everything and run `crucible demo` (outputs under runs/demo)
#   make test    install everything, start the local stack, run the whole test suite
#   make venv    only the Python environment
#   make stack   only build and start the local stack (e2e/stack.sh up)
#   make test-data  Debian packages whose real text the corpus tests read (installs only what is missing)
#   make images  build the operator and trainer images (needs a Docker engine; REGISTRY=host/path to
#                prefix them, then `make images-push`)

SHELL := /bin/bash
CACHE ?= $(HOME)/.cache/crucible
VENV ?= $(CACHE)/venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# The venv is shared between checkouts; the editable install points at one checkout, so the
# stamp is keyed on the dependency files *and* this checkout's path.
DEPS_KEY := $(shell cat pyproject.toml setup.py | sha256sum | cut -c1-12)-$(shell echo $(CURDIR) | sha256sum | cut -c1-8)
STAMP := $(VENV)/.crucible-$(DEPS_KEY)
PYTEST_ARGS ?=

.PHONY: test demo venv stack stack-down test-data images images-push operator-context trainer-context

# Images: tagged with the package version; REGISTRY (e.g. registry.example/team) prefixes them.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REGISTRY ?=
IMAGE_PREFIX := $(if $(REGISTRY),$(REGISTRY)/,)
OPERATOR_IMAGE := $(IMAGE_PREFIX)crucible-operator:$(VERSION)
TRAINER_IMAGE := $(IMAGE_PREFIX)crucible-trainer:$(VERSION)

test: venv stack test-data
	$(PY) -m pytest $(PYTEST_ARGS)

# The main job, offline on this machine: corpus -> tokenizer -> FSDP training on 2 CPU processes.
demo: venv
	$(VENV)/bin/crucible demo --out runs/demo

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[trainer,operator,dev]'
	rm -f $(VENV)/.crucible-* && touch $@

stack:
	e2e/stack.sh up

stack-down:
	e2e/stack.sh down

# Real text for tests/corpus (fortunes in four languages, man-db's translated man pages rendered
# with man/groff, pip's docs for its one "lorem ipsum" line). Idempotent: apt runs only when a
# package is missing.
CORPUS_TEST_PACKAGES := fortunes fortunes-de fortunes-it fortunes-es man-db groff-base bsdextrautils python3-pip
test-data:
	@missing=$$(for p in $(CORPUS_TEST_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null \
	  | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing test text packages: $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# Each image is built from a context that holds only what it ships, streamed to docker as a tar:
# the operator's has no trainer code (api/ is the only code both planes share).
OPERATOR_CONTEXT := pyproject.toml setup.py README.md api operator
TRAINER_CONTEXT := pyproject.toml setup.py README.md api trainer
CONTEXT_TAR = tar -c --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info'

operator-context:
	@$(CONTEXT_TAR) $(OPERATOR_CONTEXT)

trainer-context:
	@$(CONTEXT_TAR) $(TRAINER_CONTEXT)

images:
	$(MAKE) -s operator-context | docker build -f operator/Dockerfile -t $(OPERATOR_IMAGE) -
	$(MAKE) -s trainer-context | docker build -f trainer/Dockerfile -t $(TRAINER_IMAGE) -

images-push: images
	docker push $(OPERATOR_IMAGE)
	docker push $(TRAINER_IMAGE)
