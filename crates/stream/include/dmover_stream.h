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

/* Generated from src/ffi.rs by cbindgen (cbindgen.toml): edit those, not this file. */

#include <stddef.h>
#include <stdint.h>

/**
 * Success.
 */
#define DMS_OK 0

/**
 * A bug: please report it.
 */
#define DMS_EINTERNAL 1

/**
 * A bad argument or configuration.
 */
#define DMS_EUSAGE 2

/**
 * E.g. the spill directory does not exist.
 */
#define DMS_ENOTFOUND 3

/**
 * Permission denied (spill directory).
 */
#define DMS_EPERMISSION 4

/**
 * The spill directory is full.
 */
#define DMS_ENOSPACE 5

/**
 * No sink reachable, or blocks left undelivered.
 */
#define DMS_EUNREACHABLE 6

/**
 * The sinks do not know this token.
 */
#define DMS_EAUTH 7

/**
 * A sink refused the stream.
 */
#define DMS_EREFUSED 8

/**
 * Data read back damaged.
 */
#define DMS_EVERIFY 10

/**
 * An open stream; opaque.
 */
typedef struct dms_stream dms_stream;

/**
 * What dms_close reports.
 */
typedef struct dms_report {
    uint64_t steps;
    /**
     * Bytes written by the producer.
     */
    uint64_t bytes;
    uint64_t blocks;
    /**
     * Blocks that overflowed the buffer to disk.
     */
    uint64_t spilled_blocks;
    uint64_t spilled_bytes;
    /**
     * Sent again after a failover or damage.
     */
    uint64_t resent_blocks;
    /**
     * Times a sink failed and the next took over.
     */
    uint64_t failovers;
    /**
     * Left in the spill file at close.
     */
    uint64_t undelivered_blocks;
    /**
     * Most data connections used at once.
     */
    uint32_t max_streams;
    double seconds;
} dms_report;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

/**
 * Opens a stream and connects to the first sink that accepts it. The
 * close and ack timeouts come from DMOVER_CLOSE_TIMEOUT and
 * DMOVER_ACK_TIMEOUT (seconds) if set, else 600 s and 90 s; dms_set_timeouts
 * changes them. The replicas come from DMOVER_REPLICAS if set, else 1;
 * dms_set_replicas changes them.
 *   producer      this producer's name: 1-64 of [A-Za-z0-9._-], e.g. "gtc-17"
 *   destinations  sinks as "host:port,host:port,...", in order of preference
 *   spill_dir     an existing directory for overflow and the manifest
 *   buffer_bytes  circular buffer size (0: 80 MiB)
 *   block_bytes   block size, 4 KiB to 64 MiB (0: 1 MiB)
 *   max_wait_ms   longest a write waits for room before spilling (0: never waits)
 *   out           receives the handle; the caller owns it until dms_close
 *
 * # Safety
 * String arguments are valid NUL-terminated strings (or NULL, refused);
 * out is valid for one pointer write.
 */
int dms_open(const char *producer,
             const char *destinations,
             const char *spill_dir,
             uint64_t buffer_bytes,
             uint64_t block_bytes,
             uint32_t max_wait_ms,
             struct dms_stream **out);

/**
 * Copies len bytes into the buffer and returns (the data is not retained).
 *
 * # Safety
 * h is a live handle; data is valid for reads of len bytes.
 */
int dms_write(struct dms_stream *h, const void *data, size_t len);

/**
 * Attaches key=value to the current step (e.g. "var"="phi", "dims"="64,64").
 *
 * # Safety
 * h is a live handle; key and value are valid NUL-terminated strings.
 */
int dms_write_metadata(struct dms_stream *h, const char *key, const char *value);

/**
 * Sets how long dms_close waits for delivery before leaving what is left
 * in the spill file (close_seconds), and how long a sink may acknowledge
 * nothing while blocks wait for it before it is taken for dead and the next
 * one takes over (ack_seconds); 0 leaves one unchanged.
 *
 * # Safety
 * h is a live handle.
 */
int dms_set_timeouts(struct dms_stream *h, double close_seconds, double ack_seconds);

/**
 * Sets how many sinks each step goes to, whole: 1 (the default, or
 * DMOVER_REPLICAS if set) to the number of destinations. A block's memory
 * is freed only when that many sinks hold it; when one fails, the next
 * destination takes its place and gets a copy of what it held.
 *
 * # Safety
 * h is a live handle.
 */
int dms_set_replicas(struct dms_stream *h, uint32_t replicas);

/**
 * Ends the current time step.
 *
 * # Safety
 * h is a live handle.
 */
int dms_end_step(struct dms_stream *h);

/**
 * Ends the current step if anything was written to it, sends everything
 * left, fills *report (if not NULL) and frees the handle, even when it
 * returns an error. SPILL_DIR/PRODUCER.PID.manifest.json is kept if
 * anything is left to drain (or DMOVER_KEEP_MANIFEST=1), removed otherwise.
 *
 * # Safety
 * h is NULL or a live handle, which is invalid afterwards; report is
 * NULL or valid for one write.
 */
int dms_close(struct dms_stream *h, struct dms_report *report);

/**
 * The calling thread's last error message ("" if none); valid until its next call.
 */
const char *dms_last_error(void);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* DMOVER_STREAM_H */
