#!/usr/bin/env bash
# Prints the base image for the Dockerfile (its BASE_IMAGE build argument), making one if needed:
# $CGAD_BASE_IMAGE when set; else the registry's python:3.11-slim when it is here or can be
# pulled; else the local one made from Debian's packages (deploy/make_base_image.sh, made once and
# kept). Progress goes to stderr, so `make compose-up` can take the name from stdout.
set -euo pipefail

USUAL=python:3.11-slim
LOCAL=cgad-node-base:bookworm

if [ -n "${CGAD_BASE_IMAGE:-}" ]; then
    echo "$CGAD_BASE_IMAGE"
elif docker image inspect "$USUAL" >/dev/null 2>&1 || timeout 300 docker pull -q "$USUAL" >/dev/null 2>&1; then
    echo "$USUAL"
elif docker image inspect "$LOCAL" >/dev/null 2>&1; then
    echo "$USUAL cannot be pulled: using the local base $LOCAL" >&2
    echo "$LOCAL"
else
    echo "$USUAL cannot be pulled: making $LOCAL from Debian's packages (a few minutes, once)" >&2
    "$(dirname "$0")/make_base_image.sh" "$LOCAL" >&2
    echo "$LOCAL"
fi
