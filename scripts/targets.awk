# Sets the criterion medians of the scheduler and manager benchmarks (their output, in any
# order) against the vLLM 0.33 performance targets, 0.24 beside 0.33. Used by
# scripts/gpu-check.sh; `requests` is the conversation trace's request count (0: no replay).
#
#   awk -v requests=12031 -f scripts/targets.awk criterion-output.txt

function ns(v, unit) {
    if (unit == "ns") return v
    if (unit == "µs" || unit == "us") return v * 1e3
    if (unit == "ms") return v * 1e6
    if (unit == "s") return v * 1e9
    return -1
}

function per_s(v, unit) {
    if (unit == "elem/s") return v
    if (unit == "Kelem/s") return v * 1e3
    if (unit == "Melem/s") return v * 1e6
    if (unit == "Gelem/s") return v * 1e9
    return -1
}

function verdict(ok) { return ok ? "met" : "NOT MET" }

# A benchmark's name starts a line; its "time:" and "thrpt:" follow on that line or the next
# (the first of each: those after "change:" are relative to an earlier run).
/^[a-z]/ { name = $1 }
/time:/ && !((name, "t") in seen) {
    for (i = 1; i <= NF; i++) if ($i == "time:") { t[name] = ns($(i + 3), $(i + 4)); seen[name, "t"] = 1 }
}
/thrpt:/ && !((name, "thr") in seen) {
    for (i = 1; i <= NF; i++) if ($i == "thrpt:") { thr[name] = per_s($(i + 3), $(i + 4)); seen[name, "thr"] = 1 }
}

END {
    step = "scheduler_build_step/256_requests/"
    for (k = 1; k <= 2; k++) {
        api = k == 1 ? "rust" : "c_abi"
        one24 = t[step api "/factor1_prompt16"]; one33 = t[step api "/factor1_prompt16_v033"]
        f424 = t[step api "/factor4_prompt8192"]; f433 = t[step api "/factor4_prompt8192_v033"]
        if (one33 > 0)
            printf "build_step 256 one-chunk requests, %-5s  0.24 %8.1f us  0.33 %8.1f us (%.2fx)  target 0.33 <= 50 us: %s\n",
                api, one24 / 1e3, one33 / 1e3, (one24 > 0 ? one33 / one24 : 0), verdict((one33 <= 50e3))
        if (f433 > 0 && one33 > 0)
            printf "build_step factor 4, 8,192 tokens, %-5s  0.24 %8.1f us  0.33 %8.1f us (%.2fx of one-chunk)  target 0.33 <= 2x: %s\n",
                api, f424 / 1e3, f433 / 1e3, f433 / one33, verdict((f433 <= 2 * one33))
    }
    if (requests > 0) {
        r = "replay_conversation_5859_slots/"
        for (p = 1; p <= 2; p++) {
            pol = p == 1 ? "Lru" : "Arc"
            a = thr[r "rust/" pol]; b = thr[r "rust/" pol "_v033"]
            if (b > 0)
                printf "replay %s, rust   0.24 %6.1f ns/block  0.33 %6.1f ns/block  target 0.33 <= 45 ns/block: %s\n",
                    pol, (a > 0 ? 1e9 / a : 0), 1e9 / b, verdict((1e9 / b <= 45))
            a = t[r "c_abi/" pol]; b = t[r "c_abi/" pol "_v033"]
            if (b > 0)
                printf "replay %s, c_abi  0.24 %6.2f us/request  0.33 %6.2f us/request  target 0.33 <= 2 us/request: %s\n",
                    pol, a / requests / 1e3, b / requests / 1e3, verdict((b / requests <= 2e3))
        }
    }
}
