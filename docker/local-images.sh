#!/usr/bin/env bash
# Stand-ins for the public images that docker-compose.yml uses, built from Debian's packages, for machines
# that cannot reach Docker Hub (air-gapped, or a network that blocks it). Needs root (debootstrap), a running
# Docker daemon and a Debian mirror (DEBIAN_MIRROR). Builds, once each (an existing image is kept; FORCE=1
# rebuilds):
#
#   rollway-local/debian:bookworm    debootstrap --variant=minbase bookworm, imported with `docker import`
#   rollway-local/python:3.11-slim   for python:3.11-slim: Debian's python3 (3.11), pip, `python`, CA
#                                    certificates; pip installs as root into /usr/local as in the official
#                                    image (Debian's "externally managed" marker removed)
#   rollway-local/postgres:15        for postgres:17: Debian's PostgreSQL 15 behind an entrypoint that keeps
#                                    the official image's contract: POSTGRES_USER / POSTGRES_PASSWORD /
#                                    POSTGRES_DB / POSTGRES_INITDB_ARGS / POSTGRES_HOST_AUTH_METHOD, PGDATA
#                                    (default /var/lib/postgresql/data), /docker-entrypoint-initdb.d/*.sql|*.sh
#                                    on first start, pg_isready on PATH, port 5432, STOPSIGNAL SIGINT
#
# Then point the compose files at them (in .env or the environment):
#   BASE_IMAGE=rollway-local/python:3.11-slim
#   POSTGRES_IMAGE=rollway-local/postgres:15
# PostgreSQL 15 is what Debian bookworm ships; the store needs nothing newer, but a data volume written by one
# major cannot be opened by another: keep one POSTGRES_IMAGE per pgdata volume.
set -euo pipefail

PREFIX=${PREFIX:-rollway-local}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
FORCE=${FORCE:-0}

have() { [ "$FORCE" != 1 ] && docker image inspect "$1" > /dev/null 2>&1; }
say() { echo "local-images: $*" >&2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if have "$PREFIX/debian:bookworm"; then
  say "$PREFIX/debian:bookworm exists"
else
  # Everything but the image names goes to stderr: .ci/docker_setup.sh's stdout is read as KEY=VALUE lines.
  command -v debootstrap > /dev/null \
    || apt-get install -y debootstrap >&2 || { apt-get update >&2 && apt-get install -y debootstrap >&2; }
  say "debootstrap bookworm from $MIRROR"
  t0=$(date +%s)
  debootstrap --variant=minbase bookworm "$tmp/root" "$MIRROR" > "$tmp/debootstrap.log" 2>&1 \
    || { tail -30 "$tmp/debootstrap.log" >&2; exit 1; }
  # The mirror the image's apt uses, and no daemons started by package scripts (there is no init).
  echo "deb $MIRROR bookworm main" > "$tmp/root/etc/apt/sources.list"
  printf '#!/bin/sh\nexit 101\n' > "$tmp/root/usr/sbin/policy-rc.d"
  chmod 755 "$tmp/root/usr/sbin/policy-rc.d"
  rm -rf "$tmp"/root/var/cache/apt/archives/*.deb "$tmp"/root/var/lib/apt/lists/*
  tar -C "$tmp/root" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' \
    - "$PREFIX/debian:bookworm" > /dev/null
  rm -rf "$tmp/root"
  say "$PREFIX/debian:bookworm built in $(( $(date +%s) - t0 )) s"
fi

if have "$PREFIX/python:3.11-slim"; then
  say "$PREFIX/python:3.11-slim exists"
else
  mkdir -p "$tmp/python"
  cat > "$tmp/python/Dockerfile" <<EOF
FROM $PREFIX/debian:bookworm
RUN apt-get update \\
    && apt-get install -y --no-install-recommends python3 python3-pip python3-venv python-is-python3 \\
       ca-certificates \\
    && rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED \\
    && rm -rf /var/lib/apt/lists/* \\
    && python --version && pip --version
CMD ["python3"]
EOF
  say "building $PREFIX/python:3.11-slim"
  DOCKER_BUILDKIT=0 docker build -q -t "$PREFIX/python:3.11-slim" "$tmp/python" > /dev/null
fi

if have "$PREFIX/postgres:15"; then
  say "$PREFIX/postgres:15 exists"
else
  mkdir -p "$tmp/postgres"
  cat > "$tmp/postgres/Dockerfile" <<EOF
FROM $PREFIX/debian:bookworm
# postgresql-common first, told not to create a cluster: the entrypoint creates one in PGDATA.
RUN apt-get update \\
    && apt-get install -y --no-install-recommends postgresql-common \\
    && sed -ri 's/#? *(create_main_cluster) .*$/\\1 = false/' /etc/postgresql-common/createcluster.conf \\
    && apt-get install -y --no-install-recommends postgresql-15 \\
    && rm -rf /var/lib/apt/lists/* \\
    && mkdir -p /docker-entrypoint-initdb.d /var/run/postgresql \\
    && chown postgres:postgres /var/run/postgresql
ENV PATH=/usr/lib/postgresql/15/bin:\$PATH \\
    PGDATA=/var/lib/postgresql/data
COPY docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME /var/lib/postgresql/data
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
EOF
  cat > "$tmp/postgres/docker-entrypoint.sh" <<'EOF'
#!/bin/sh
# The official postgres image's entrypoint contract, for Debian's PostgreSQL (see docker/local-images.sh).
set -eu
case "${1:-postgres}" in -*) set -- postgres "$@" ;; esac
[ $# -gt 0 ] || set -- postgres
if [ "$1" != postgres ]; then exec "$@"; fi
: "${PGDATA:=/var/lib/postgresql/data}"
export PGDATA

if [ "$(id -u)" = 0 ]; then
  mkdir -p "$PGDATA"
  chmod 700 "$PGDATA"
  find "$PGDATA" \! -user postgres -exec chown postgres:postgres '{}' +
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  : "${POSTGRES_USER:=postgres}"
  : "${POSTGRES_DB:=$POSTGRES_USER}"
  auth=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}
  if [ -z "${POSTGRES_PASSWORD:-}" ] && [ "$auth" != trust ]; then
    echo "Error: database is uninitialized and superuser password is not specified." >&2
    echo "  Set POSTGRES_PASSWORD (or POSTGRES_HOST_AUTH_METHOD=trust)." >&2
    exit 1
  fi
  pwfile=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:-}" > "$pwfile"
  # shellcheck disable=SC2086  # POSTGRES_INITDB_ARGS is split on purpose, as the official image does
  initdb --username="$POSTGRES_USER" --pwfile="$pwfile" ${POSTGRES_INITDB_ARGS:-}
  rm -f "$pwfile"
  printf 'host all all all %s\n' "$auth" >> "$PGDATA/pg_hba.conf"
  printf "listen_addresses = '*'\n" >> "$PGDATA/postgresql.conf"
  # First-time setup on the unix socket only, as the official image does.
  pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start
  export PGPASSWORD="${POSTGRES_PASSWORD:-}"
  psql="psql -v ON_ERROR_STOP=1 --no-psqlrc --username=$POSTGRES_USER"
  if [ "$POSTGRES_DB" != postgres ]; then
    $psql --dbname=postgres --set db="$POSTGRES_DB" <<'SQL'
CREATE DATABASE :"db";
SQL
  fi
  for f in /docker-entrypoint-initdb.d/*; do
    case "$f" in
      *.sh) echo "running $f"; . "$f" ;;
      *.sql) echo "running $f"; $psql --dbname="$POSTGRES_DB" -f "$f" ;;
      *) ;;
    esac
  done
  pg_ctl -D "$PGDATA" -m fast -w stop
  unset PGPASSWORD
  echo "PostgreSQL init process complete; ready for start up."
fi
exec "$@"
EOF
  chmod 755 "$tmp/postgres/docker-entrypoint.sh"
  say "building $PREFIX/postgres:15"
  DOCKER_BUILDKIT=0 docker build -q -t "$PREFIX/postgres:15" "$tmp/postgres" > /dev/null
fi

docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' "$PREFIX/*" >&2
