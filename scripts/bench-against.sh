#!/usr/bin/env bash
# Compares the criterion benchmarks of an older revision with the working tree's, run
# alternately in one session (on a shared machine the speed drifts between runs; alternating
# spreads the drift over both sides). Prints each run's median, then per case the median of
# each side's medians, their ratio (working tree / revision) and the median of the rounds'
# ratios ("ratio/r": each round's two runs are neighbours in time, so it drifts least).
#
#   scripts/bench-against.sh REV BENCH FILTER...
#
#   REV      any git revision; its bench executable is built in a detached worktree under
#            target/bench-against/ (kept, so a second comparison with REV builds nothing new)
#   BENCH    a bench target of both revisions: manager, scheduler or transfer
#   FILTER   criterion filters (regular expressions), one case each, e.g.
#            'rust/factor1_prompt16$' 'rust/Lru_v033'; a case the revision lacks is reported
#            as absent on that side. 'OLD vs NEW' runs filter OLD on the revision and NEW on
#            the working tree (a case against another one, or one renamed since)
#
# Environment: ROUNDS (default 5) alternations; MEASURE seconds of measurement per run
# (default 3); KVO_TRACES the folder of the request traces (default ../shared/traces) for the
# replay cases, given to both sides.
#
# Example (the one-chunk step of the revision before vLLM 0.33 semantics came, against this
# tree's in both semantics):
#   scripts/bench-against.sh 7d869da~1 scheduler 'rust/factor1_prompt16$' \
#       'rust/factor1_prompt16$ vs rust/factor1_prompt16_v033'
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
cd "$(dirname "$0")/.."
rev=$(git rev-parse --short=12 "$1^{commit}")
bench=$2
shift 2
rounds=${ROUNDS:-5}
measure=${MEASURE:-3}
work=$PWD/target/bench-against
traces=${KVO_TRACES:-$PWD/../shared/traces}
mkdir -p "$work"

# The bench executable of the tree at $1 built into target dir $2 (cargo's JSON names it).
build() {
    (cd "$1" && CARGO_TARGET_DIR=$2 cargo bench -q --bench "$bench" --no-run --message-format=json) |
        grep -o '"executable":"[^"]*"' | tail -n 1 | cut -d'"' -f4
}

src=$work/src-$rev
if [ ! -d "$src" ]; then
    git worktree add --detach --force "$src" "$rev" >/dev/null
fi
# A revision from before KVO_TRACES looked for the traces beside its checkout.
if [ -d "$traces" ] && [ ! -e "$work/shared/traces" ]; then
    mkdir -p "$work/shared"
    ln -s "$(cd "$traces" && pwd)" "$work/shared/traces"
fi
echo "building $bench at $rev and in the working tree..." >&2
old=$(build "$src" "$work/target-$rev")
new=$(build "$PWD" "$PWD/target")
[ -x "$old" ] && [ -x "$new" ] || { echo "bench-against: no executable for $bench" >&2; exit 1; }

export KVO_TRACES=$traces
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for r in $(seq "$rounds"); do
    for f in "$@"; do
        for side in "$rev" tree; do
            exe=$old filter=${f%% vs *}
            [ "$side" = tree ] && exe=$new filter=${f##* vs }
            # criterion: "<name>  time:   [low median high]"; the median is the 4th field on.
            m=$("$exe" --bench --noplot --warm-up-time 1 --measurement-time "$measure" "$filter" 2>/dev/null |
                awk '!seen && /time:/ { for (i = 1; i <= NF; i++) if ($i == "time:") { print $(i + 3), $(i + 4); seen = 1 } }')
            echo "round $r  $side  $f  ${m:-absent}"
            if [ -n "$m" ]; then echo "$f	$side	$r	$m" >>"$results"; fi
        done
    done
done

echo
printf '%-58s %14s %14s %7s %7s\n' case "$rev" tree ratio "ratio/r"
awk -F'\t' -v rev="$rev" '
    function ns(v, u) { return v * (u == "ms" ? 1e6 : u == "s" ? 1e9 : u == "ns" ? 1 : 1e3) }
    # The median of the space-separated numbers in s ("" when none).
    function median(s,   n, i, j, t, a) {
        n = split(s, a, " ")
        for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] + 0 > a[j] + 0; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
        return n == 0 ? "" : (n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2)
    }
    function show(v) { return v == "" ? "absent" : v >= 1e6 ? sprintf("%.3f ms", v / 1e6) : sprintf("%.2f us", v / 1e3) }
    {
        split($4, t, " "); v = ns(t[1], t[2])
        runs[$1, $2] = runs[$1, $2] " " v; at[$1, $2, $3] = v
        if (!($1 in seen)) { seen[$1]; order[++k] = $1 }
        if ($3 > rounds) rounds = $3
    }
    END {
        for (i = 1; i <= k; i++) {
            c = order[i]; o = median(runs[c, rev]); w = median(runs[c, "tree"]); q = ""
            for (r = 1; r <= rounds; r++) if ((c, rev, r) in at && (c, "tree", r) in at) q = q " " at[c, "tree", r] / at[c, rev, r]
            q = median(q)
            printf "%-58s %14s %14s %7s %7s\n", c, show(o), show(w), (o != "" && w != "") ? sprintf("%.3f", w / o) : "-", q == "" ? "-" : sprintf("%.3f", q)
        }
    }' "$results"
