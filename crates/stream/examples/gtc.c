/*
 * gtc.c — a stand-in for the GTC simulation streaming its output with
 * dmover-stream: STEPS time steps, each "computing" for COMPUTE_MS and
 * producing one array phi of N doubles, phi[i] = step * 1000003 + i.
 *
 *   gtc PRODUCER SINKS SPILL_DIR STEPS N COMPUTE_MS [BUFFER_MB] [BLOCK_KB]
 *
 * SINKS is "host:port[,host:port...]"; the token is in DMOVER_TOKEN or the
 * file DMOVER_TOKEN_FILE names. Prints one line with the report and the
 * process's CPU time.
 *
 * For benchmarks: GTC_BUSY=1 makes each step's compute real work (the main
 * thread spins until it has used COMPUTE_MS of CPU, so the work per step is
 * the same whatever else runs), and GTC_STREAM=0 does everything but stream
 * (the baseline for the streaming overhead).
 *
 * Build, from the repository's top directory (docs/STREAMING.md):
 *   cargo build --release -p dmover-stream
 *   cc -O2 -I crates/stream/include crates/stream/examples/gtc.c target/release/libdmover_stream.a -lpthread -ldl -lm -o gtc
 */
#include <dmover_stream.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>

static int check(int rc, const char *what) {
    if (rc != DMS_OK) {
        fprintf(stderr, "gtc: %s failed (%d): %s\n", what, rc, dms_last_error());
        exit(rc);
    }
    return rc;
}

static double clock_s(clockid_t c) {
    struct timespec t;
    clock_gettime(c, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double now(void) { return clock_s(CLOCK_MONOTONIC); }

/* Spins until this thread has used `s` seconds of CPU; returns a value so
   that the work is not optimized away. */
static double spin(double s) {
    double end = clock_s(CLOCK_THREAD_CPUTIME_ID) + s, x = 1.0;
    while (clock_s(CLOCK_THREAD_CPUTIME_ID) < end)
        for (int i = 0; i < 10000; i++) x = x * 1.0000001 + 1e-9;
    return x;
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s PRODUCER SINKS SPILL_DIR STEPS N COMPUTE_MS [BUFFER_MB] [BLOCK_KB]\n", argv[0]);
        return 2;
    }
    long steps = atol(argv[4]), n = atol(argv[5]), compute_ms = atol(argv[6]);
    uint64_t buffer = argc > 7 ? (uint64_t)atol(argv[7]) << 20 : 0;
    uint64_t block = argc > 8 ? (uint64_t)atol(argv[8]) << 10 : 0;
    double *phi = malloc(n * sizeof(double));
    if (!phi) return 1;
    char dims[32], step_s[32];
    snprintf(dims, sizeof dims, "%ld", n);
    int busy = getenv("GTC_BUSY") && atoi(getenv("GTC_BUSY"));
    int stream = !getenv("GTC_STREAM") || atoi(getenv("GTC_STREAM"));
    double sink = 0, start = now();

    dms_stream *s = NULL;
    if (stream) check(dms_open(argv[1], argv[2], argv[3], buffer, block, 0, &s), "dms_open");
    for (long step = 0; step < steps; step++) {
        double t0 = now();
        for (long i = 0; i < n; i++) phi[i] = (double)(step * 1000003 + i);
        if (busy) {
            sink += spin(compute_ms * 1e-3);
        } else {
            /* The rest of the step's compute time. */
            double left = compute_ms * 1e-3 - (now() - t0);
            if (left > 0) {
                struct timespec ts = {(time_t)left, (long)((left - (time_t)left) * 1e9)};
                nanosleep(&ts, NULL);
            }
        }
        if (!stream) continue;
        snprintf(step_s, sizeof step_s, "%ld", step);
        check(dms_write_metadata(s, "var", "phi"), "dms_write_metadata");
        check(dms_write_metadata(s, "dims", dims), "dms_write_metadata");
        check(dms_write_metadata(s, "step", step_s), "dms_write_metadata");
        check(dms_write(s, phi, n * sizeof(double)), "dms_write");
        check(dms_end_step(s), "dms_end_step");
    }
    double compute_end = now();
    dms_report r = {0};
    int rc = stream ? dms_close(s, &r) : DMS_OK;
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    printf("steps=%llu bytes=%llu spilled_blocks=%llu spilled_bytes=%llu failovers=%llu undelivered=%llu max_streams=%u "
           "seconds=%.3f compute_s=%.3f wall_s=%.3f cpu_user=%.3f cpu_sys=%.3f check=%g\n",
           (unsigned long long)r.steps, (unsigned long long)r.bytes, (unsigned long long)r.spilled_blocks,
           (unsigned long long)r.spilled_bytes, (unsigned long long)r.failovers, (unsigned long long)r.undelivered_blocks,
           r.max_streams, r.seconds, compute_end - start, now() - start, u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6,
           u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6, sink);
    check(rc, "dms_close");
    free(phi);
    return 0;
}
