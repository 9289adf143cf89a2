# Crucible: set-up and tests. Everything heavy is cached under ~/.cache/crucible, not in the repo.
#   make demo    install everything and run `crucible demo` (outputs under runs/demo)
#   make test    install everything, start the local stack and a Docker engine, build the images, run
#                the whole test suite in parallel (PYTEST_WORKERS=2 processes); KIND=1 adds the kind
#                end to end with its chaos (e2e/kind/run.sh)
#   make venv    only the Python environment
#   make stack   only build and start the local stack (e2e/stack.sh up)
#   make test-data  Debian packages whose real text the corpus tests read (installs only what is missing)
#   make images  build the operator and trainer images (needs a Docker engine, e.g. e2e/host/docker.sh;
#                REGISTRY=host/path to prefix them, then `make images-push`; BASE=local builds them on
#                a Debian base made here, `make base`, when no registry is reachable)
#   make requirements  regenerate the images' hash-locked dependencies (requirements/*.txt)

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

.PHONY: test demo venv stack stack-down test-data images images-push operator-context trainer-context \
	requirements base local-images

# Images: tagged with the package version; REGISTRY (e.g. registry.example/team) prefixes them.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REGISTRY ?=
IMAGE_PREFIX := $(if $(REGISTRY),$(REGISTRY)/,)
OPERATOR_IMAGE := $(IMAGE_PREFIX)crucible-operator:$(VERSION)
TRAINER_IMAGE := $(IMAGE_PREFIX)crucible-trainer:$(VERSION)

# The whole suite: pytest against the local stack, after the images are built (so the `docker`
# tests check these very images); with KIND=1 pytest is followed by the kind end to end with its
# chaos (e2e/kind/run.sh; its cluster is kept for the next run). KIND is off by default: a
# fresh-clone run of this command on a new machine passed in 94.6 min, over CI's 90 (docs/kind.md,
# "Timings").
# Order: what runs apt on this host first, one after the other (apt and dpkg take locks): the
# test text, the Docker engine, the Debian base (debootstrap); then the stack's Go builds beside
# the image builds (cold: CPU beside downloads and disk; warm: both are no-ops in seconds; the
# stack's own apt use, Prometheus's package, then has apt to itself), its lines prefixed [stack];
# then
# pytest in PYTEST_WORKERS processes (pytest-xdist, --dist loadgroup: tests/conftest.py keeps the
# cluster tests in one of them).
KIND ?= 0
PYTEST_WORKERS ?= 2
test: venv test-data
	e2e/host/docker.sh
	$(MAKE) --no-print-directory base
	@set -o pipefail; e2e/stack.sh up 2>&1 | sed -u 's/^/[stack] /' & stack=$$!; \
	  MAKEFLAGS=--no-print-directory $(MAKE) --no-print-directory images; built=$$?; \
	  wait $$stack || { echo "the local stack did not come up (lines marked [stack] above)" >&2; exit 1; }; \
	  exit $$built
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)
ifeq ($(KIND),1)
	CRUCIBLE_VENV=$(VENV) e2e/kind/run.sh all
endif

# A Docker engine (started when `docker info` fails) and both images, on the Debian base made here
# when the Dockerfiles' public bases are not in the image store (no registry is reachable here).
local-images:
	e2e/host/docker.sh
	$(MAKE) --no-print-directory base
	MAKEFLAGS=--no-print-directory $(MAKE) --no-print-directory images

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
# Each also holds its image's hash-locked dependencies (requirements/<image>.txt, `make requirements`).
OPERATOR_CONTEXT := pyproject.toml setup.py README.md requirements/operator.txt api operator
TRAINER_CONTEXT := pyproject.toml setup.py README.md requirements/trainer.txt api trainer
CONTEXT_TAR = tar -c --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info'

operator-context:
	@$(CONTEXT_TAR) $(OPERATOR_CONTEXT)

trainer-context:
	@$(CONTEXT_TAR) $(TRAINER_CONTEXT)

# The images' dependencies, hash-locked, one lock per image: requirements/<image>.txt is
# pyproject.toml's base dependencies + that image's extra + the build backend (requirements/build.in,
# the project is installed with --no-build-isolation), wheels only, installed with
# `pip install --require-hashes --no-deps`. Each lock is valid for every Python the images run:
# 3.12 on the public bases (python:3.12 slim, Ubuntu 24.04's python3) and 3.11 on the local Debian 12
# base (BASE=local below). uv resolves it universally (--universal) with LOCK_PYTHON, the project's
# requires-python floor, as the lower bound: a package whose newest release dropped 3.11 is locked
# twice, each pin under a python_full_version marker that pip evaluates at install, and the hashes
# cover every wheel of each pinned version. Each lock is then resolved again for Linux x86_64 with
# each of IMAGE_PYTHONS, constrained to the lock, so a pin without a wheel there fails here, not in
# an image build. Run after changing a pin in pyproject.toml (tests/ship/test_requirements_lock.py
# fails until then). The existing lock is uv's preference, so other packages keep their versions;
# `make requirements UV_ARGS=--upgrade` moves them to the newest that fit. uv is pinned and
# installed under ~/.cache/tools when missing.
UV_VERSION := 0.13.9
UV := $(HOME)/.cache/tools/uv-$(UV_VERSION)/bin/uv
UV_ARGS ?=
LOCK_IMAGES := operator trainer
LOCK_PYTHON := 3.11
IMAGE_PYTHONS := 3.11 3.12
requirements:
	@test -x $(UV) || { $(PYTHON) -m venv $(HOME)/.cache/tools/uv-$(UV_VERSION) \
	  && $(HOME)/.cache/tools/uv-$(UV_VERSION)/bin/pip install --quiet uv==$(UV_VERSION); }
	@set -e; for image in $(LOCK_IMAGES); do \
	  $(UV) pip compile --quiet pyproject.toml requirements/build.in --extra $$image --generate-hashes \
	    --universal --python-version $(LOCK_PYTHON) --only-binary :all: $(UV_ARGS) \
	    -o requirements/$$image.txt; \
	  sed -i '1i # Generated by `make requirements` (uv $(UV_VERSION)); do not edit by hand. Its command:' \
	    requirements/$$image.txt; \
	  for py in $(IMAGE_PYTHONS); do \
	    $(UV) pip compile --quiet pyproject.toml requirements/build.in --extra $$image \
	      --python-version $$py --python-platform x86_64-manylinux_2_28 --only-binary :all: \
	      -c requirements/$$image.txt -o /dev/null \
	    || { echo "requirements/$$image.txt does not resolve for Python $$py on Linux x86_64" >&2; exit 1; }; \
	  done; \
	  echo "requirements/$$image.txt: $$(grep -c '^[A-Za-z0-9]' requirements/$$image.txt) pins, checked for Python $(IMAGE_PYTHONS)"; \
	done

# The images' base (BASE=...): `public`: the Dockerfiles' pinned bases (python:3.12 slim for the
# operator, nvidia/cuda for the trainer), pulled from their registry unless present; `local`:
# LOCAL_BASE, a Debian image with Python made on this machine from Debian's archive by
# e2e/images/base.sh (no registry needed; `make base` makes it); `auto` (the default): per image,
# the public base when it is in the local image store, else LOCAL_BASE when that exists, else
# public (a pull). The build says which. `make images-push` always builds on the public bases and
# refuses BASE=local. DOCKER_BUILD_ARGS go to every `docker build` (e.g. --network=host).
BASE ?= auto
BASE_SUITE ?= bookworm
LOCAL_BASE ?= crucible-base/debian-python:$(BASE_SUITE)
DOCKER_BUILD_ARGS ?=

base:
	SUITE=$(BASE_SUITE) BASE_IMAGE=$(LOCAL_BASE) e2e/images/base.sh

images:
	@set -e; for image in operator trainer; do \
	  arg=$$(sed -n 's/^ARG \(PYTHON_IMAGE\|CUDA_IMAGE\)=.*/\1/p' $$image/Dockerfile); \
	  public=$$(sed -n "s/^ARG $$arg=//p" $$image/Dockerfile); \
	  case "$(BASE)" in \
	    public) base=$$public ;; \
	    local) base=$(LOCAL_BASE) ;; \
	    auto) if ! docker image inspect "$$public" >/dev/null 2>&1 \
	            && docker image inspect $(LOCAL_BASE) >/dev/null 2>&1; then base=$(LOCAL_BASE); \
	          else base=$$public; fi ;; \
	    *) echo "BASE=$(BASE): use public, local or auto" >&2; exit 2 ;; \
	  esac; \
	  tag=$(IMAGE_PREFIX)crucible-$$image:$(VERSION); \
	  echo "== $$tag on $$base"; \
	  $(MAKE) -s $$image-context | docker build $(DOCKER_BUILD_ARGS) --build-arg "$$arg=$$base" \
	    -f $$image/Dockerfile -t $$tag -; \
	done

# A release (`make images-push`) refuses bases pinned by tag only: a tag can be re-pushed, so the
# same crucible version could ship on a different, unreviewed base, and a warning would scroll by
# unread in a long build log. Refusing up front, before any build, is the least surprising: the
# message says how to pin, and local builds (`make images`, e2e/kind) are unaffected. Pin by
# setting the ARG default in the Dockerfile to name:tag@sha256:<digest> (`crane digest name:tag`
# or `docker buildx imagetools inspect name:tag`); ALLOW_UNPINNED_BASE=1 pushes anyway, warning.
ifneq ($(filter images-push,$(MAKECMDGOALS)),)
ifeq ($(BASE),local)
$(error images-push refuses BASE=local: a base made on one machine (with its CA certificates) is \
  for local runs, not for release)
endif
override BASE := public
UNPINNED_BASES := $(shell sed -n 's/^ARG \(PYTHON_IMAGE\|CUDA_IMAGE\)=//p' operator/Dockerfile \
  trainer/Dockerfile | grep -Ev '@sha256:[0-9a-f]{64}$$')
ifneq ($(strip $(UNPINNED_BASES)),)
UNPINNED_MESSAGE := base image(s) pinned by tag only, not by digest: $(strip $(UNPINNED_BASES)). \
  Get each digest with `crane digest NAME:TAG` (or `docker buildx imagetools inspect NAME:TAG`) \
  and set the ARG default in operator/Dockerfile or trainer/Dockerfile to NAME:TAG@sha256:DIGEST
ifeq ($(ALLOW_UNPINNED_BASE),1)
$(warning WARNING: ALLOW_UNPINNED_BASE=1: pushing images built on $(UNPINNED_MESSAGE))
else
$(error images-push refuses $(UNPINNED_MESSAGE); ALLOW_UNPINNED_BASE=1 pushes anyway)
endif
endif
endif

images-push: images
	docker push $(OPERATOR_IMAGE)
	docker push $(TRAINER_IMAGE)
