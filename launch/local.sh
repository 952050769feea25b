#!/usr/bin/env bash
# N local CPU processes of one dynjax run: launch/local.sh --processes 2 --devices-per-process 4 -- <train args>
exec python3 -m dynjax.launch.local "$@"
