/*
 * dmover_stream.h — stream a running simulation's output to dmover sinks.
 *
 * A producer opens a stream, writes its arrays (each write copies into an
 * in-memory circular buffer and returns), attaches key/value metadata, ends
 * each time step, and closes. A background thread sends the blocks to the
 * first sink that takes them (`dmover sink`), widening to more connections
 * when data backs up; blocks that do not fit in the buffer go to a spill
 * file and are sent later; if a sink dies, the next one in the list takes
 * over. Nothing is dropped: close waits until every block is acknowledged
 * (or reports where the rest is).
 *
 * Link with -ldmover_stream (libdmover_stream.so or .a; with the static
 * library also -lpthread -ldl -lm). The token comes from the DMOVER_TOKEN
 * environment variable, or the file named by DMOVER_TOKEN_FILE.
 *
 * Errors: every function returns DMS_OK (0) or an error class below;
 * dms_last_error() gives the calling thread's last error message.
 * Threads: one handle is used by one thread at a time.
 */
#ifndef DMOVER_STREAM_H
#define DMOVER_STREAM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Error classes (the same numbers as the dmover command's exit codes). */
#define DMS_OK 0
#define DMS_EINTERNAL 1    /* a bug: please report it */
#define DMS_EUSAGE 2       /* a bad argument or configuration */
#define DMS_ENOTFOUND 3    /* e.g. the spill directory does not exist */
#define DMS_EPERMISSION 4  /* permission denied (spill directory) */
#define DMS_ENOSPACE 5     /* the spill directory is full */
#define DMS_EUNREACHABLE 6 /* no sink reachable, or blocks left undelivered */
#define DMS_EAUTH 7        /* the sinks do not know this token */
#define DMS_EREFUSED 8     /* a sink refused the stream */
#define DMS_EVERIFY 10     /* data read back damaged */

/* An open stream; opaque. */
typedef struct DmsStream dms_stream;

/* What dms_close reports. */
typedef struct dms_report {
    uint64_t steps;
    uint64_t bytes;              /* bytes written by the producer */
    uint64_t blocks;
    uint64_t spilled_blocks;     /* blocks that overflowed the buffer to disk */
    uint64_t spilled_bytes;
    uint64_t resent_blocks;      /* sent again after a failover or damage */
    uint64_t failovers;          /* times a sink failed and the next took over */
    uint64_t undelivered_blocks; /* left in the spill file at close */
    uint32_t max_streams;        /* most data connections used at once */
    double seconds;
} dms_report;

/*
 * Opens a stream and connects to the first sink that accepts it.
 *   producer      this producer's name: 1-64 of [A-Za-z0-9._-], e.g. "gtc-17"
 *   destinations  sinks as "host:port,host:port,...", in order of preference
 *   spill_dir     an existing directory for overflow and the manifest
 *   buffer_bytes  circular buffer size (0: 80 MiB)
 *   block_bytes   block size, 4 KiB to 64 MiB (0: 1 MiB)
 *   max_wait_ms   longest a write waits for room before spilling (0: never waits)
 *   out           receives the handle; the caller owns it until dms_close
 */
int dms_open(const char *producer, const char *destinations, const char *spill_dir, uint64_t buffer_bytes,
             uint64_t block_bytes, uint32_t max_wait_ms, dms_stream **out);

/* Copies len bytes into the buffer and returns (the data is not retained). */
int dms_write(dms_stream *h, const void *data, size_t len);

/* Attaches key=value to the current step (e.g. "var"="phi", "dims"="64,64"). */
int dms_write_metadata(dms_stream *h, const char *key, const char *value);

/* Ends the current time step. */
int dms_end_step(dms_stream *h);

/*
 * Ends the current step if anything was written to it, sends everything
 * left, writes SPILL_DIR/PRODUCER.manifest.json, fills *report (if not
 * NULL) and frees the handle, even when it returns an error.
 */
int dms_close(dms_stream *h, dms_report *report);

/* The calling thread's last error message ("" if none); valid until its next call. */
const char *dms_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
