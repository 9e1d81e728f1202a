/*
 * gtc.c — a stand-in for the GTC simulation streaming its output with
 * dmover-stream: STEPS time steps, each "computing" for COMPUTE_MS and
 * producing one array phi of N doubles, phi[i] = step * 1000003 + i.
 *
 *   gtc PRODUCER SINKS SPILL_DIR STEPS N COMPUTE_MS [BUFFER_MB] [BLOCK_KB]
 *
 * SINKS is "host:port[,host:port...]"; the token is in DMOVER_TOKEN or the
 * file DMOVER_TOKEN_FILE names. Prints one line with the report.
 *
 * Build: cc -O2 -I crates/stream/include gtc.c -L target/release -ldmover_stream -o gtc
 */
#include <dmover_stream.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int check(int rc, const char *what) {
    if (rc != DMS_OK) {
        fprintf(stderr, "gtc: %s failed (%d): %s\n", what, rc, dms_last_error());
        exit(rc);
    }
    return rc;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
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

    dms_stream *s;
    check(dms_open(argv[1], argv[2], argv[3], buffer, block, 0, &s), "dms_open");
    for (long step = 0; step < steps; step++) {
        double t0 = now();
        for (long i = 0; i < n; i++) phi[i] = (double)(step * 1000003 + i);
        /* The rest of the step's compute time. */
        double left = compute_ms * 1e-3 - (now() - t0);
        if (left > 0) {
            struct timespec ts = {(time_t)left, (long)((left - (time_t)left) * 1e9)};
            nanosleep(&ts, NULL);
        }
        snprintf(step_s, sizeof step_s, "%ld", step);
        check(dms_write_metadata(s, "var", "phi"), "dms_write_metadata");
        check(dms_write_metadata(s, "dims", dims), "dms_write_metadata");
        check(dms_write_metadata(s, "step", step_s), "dms_write_metadata");
        check(dms_write(s, phi, n * sizeof(double)), "dms_write");
        check(dms_end_step(s), "dms_end_step");
    }
    dms_report r;
    int rc = dms_close(s, &r);
    printf("steps=%llu bytes=%llu spilled_blocks=%llu failovers=%llu undelivered=%llu max_streams=%u seconds=%.3f\n",
           (unsigned long long)r.steps, (unsigned long long)r.bytes, (unsigned long long)r.spilled_blocks,
           (unsigned long long)r.failovers, (unsigned long long)r.undelivered_blocks, r.max_streams, r.seconds);
    check(rc, "dms_close");
    free(phi);
    return 0;
}
