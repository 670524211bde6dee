#!/usr/bin/env bash
# Writes deploy/.env (the compose file's passwords) and the EMQX accounts file that seeds the same
# passwords (deploy/emqx/auth-built-in-db-bootstrap.csv), both 0600, random, once: an existing
# file is left alone. Run from anywhere; docs/cluster.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
env_file=$here/.env
accounts=$here/emqx/auth-built-in-db-bootstrap.csv
umask 077

secret() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'; }

if [ ! -e "$env_file" ]; then
    {
        echo "POSTGRES_PASSWORD=$(secret)"
        echo "DEVICE_SECRET=$(secret)$(secret)"
        echo "BROKER_PASSWORD_A=$(secret)"
        echo "BROKER_PASSWORD_B=$(secret)"
        echo "BROKER_PASSWORD_C=$(secret)"
        echo "PUBLIC_HOST=bridge.example.lan"
    } >"$env_file"
    echo "wrote $env_file (set PUBLIC_HOST: the name devices reach HAProxy at)"
fi

if [ ! -e "$accounts" ]; then
    # shellcheck disable=SC1090
    . "$env_file"
    {
        echo "user_id,password,is_superuser"
        echo "bridge-a,$BROKER_PASSWORD_A,false"
        echo "bridge-b,$BROKER_PASSWORD_B,false"
        echo "bridge-c,$BROKER_PASSWORD_C,false"
    } >"$accounts"
    echo "wrote $accounts"
fi
