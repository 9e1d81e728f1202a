//! Python bindings of `dmover-stream`: the `dmover_stream.Stream` class.
//!
//! `Stream.write` takes any object with the buffer protocol (numpy arrays,
//! `bytes`, `bytearray`, `memoryview`, `array.array`) and copies it once,
//! straight from the object's memory into the stream's circular buffer,
//! with the GIL released. Non-contiguous arrays are refused rather than
//! silently copied; pass `numpy.ascontiguousarray(a)`. Errors become Python
//! exceptions by their dmover class (`ValueError` for bad arguments,
//! `ConnectionError` when no sink can be reached, `PermissionError` for a
//! wrong token, ...).

use dmover_engine::error::Error;
use dmover_proto::ErrorKind;
use dmover_stream::{Config, Report};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyConnectionError, PyFileNotFoundError, PyOSError, PyPermissionError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyMemoryView};
use std::path::PathBuf;
use std::time::Duration;

fn py_err(e: Error) -> PyErr {
    let msg = format!("{e} ({})", e.hint());
    match e.kind {
        ErrorKind::Usage => PyValueError::new_err(msg),
        ErrorKind::NotFound => PyFileNotFoundError::new_err(msg),
        ErrorKind::Permission | ErrorKind::Auth | ErrorKind::Refused => PyPermissionError::new_err(msg),
        ErrorKind::Unreachable => PyConnectionError::new_err(msg),
        ErrorKind::NoSpace => PyOSError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

/// A stream of a running simulation's steps to dmover sinks.
#[pyclass(module = "dmover_stream._native")]
struct Stream {
    /// `None` once closed.
    inner: Option<dmover_stream::Stream>,
}

impl Stream {
    fn open(&mut self) -> PyResult<&mut dmover_stream::Stream> {
        self.inner.as_mut().ok_or_else(|| PyValueError::new_err("the stream is closed"))
    }
}

#[pymethods]
impl Stream {
    #[new]
    #[pyo3(signature = (producer, destinations, spill_dir, *, token=None, buffer=dmover_stream::DEFAULT_BUFFER,
                        block_size=dmover_stream::DEFAULT_BLOCK, max_wait=0.0, max_streams=dmover_stream::DEFAULT_MAX_STREAMS,
                        close_timeout=None, ack_timeout=None, replicas=None, keep_manifest=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        producer: &str,
        destinations: Vec<String>,
        spill_dir: PathBuf,
        token: Option<String>,
        buffer: u64,
        block_size: u32,
        max_wait: f64,
        max_streams: usize,
        close_timeout: Option<f64>,
        ack_timeout: Option<f64>,
        replicas: Option<usize>,
        keep_manifest: Option<bool>,
    ) -> PyResult<Stream> {
        let token = match token {
            Some(t) => t.into_bytes(),
            None => dmover_stream::token_from_env().map_err(py_err)?,
        };
        if !(0.0..=86_400.0).contains(&max_wait) {
            return Err(PyValueError::new_err("max_wait is seconds, 0 to 86400"));
        }
        dmover_stream::log_to_stderr();
        let dests: Vec<&str> = destinations.iter().map(String::as_str).collect();
        let mut cfg = Config::new(producer, &dests, &token, spill_dir);
        cfg.buffer = buffer;
        cfg.block_size = block_size;
        cfg.max_wait = Duration::from_secs_f64(max_wait);
        cfg.max_streams = max_streams;
        cfg.options_from_env().map_err(py_err)?;
        cfg.replicas = replicas.unwrap_or(cfg.replicas);
        cfg.keep_manifest = keep_manifest.unwrap_or(cfg.keep_manifest);
        for (name, given, field) in
            [("close_timeout", close_timeout, &mut cfg.close_timeout), ("ack_timeout", ack_timeout, &mut cfg.ack_timeout)]
        {
            if let Some(s) = given {
                *field = dmover_stream::seconds(&s.to_string()).map_err(|m| PyValueError::new_err(format!("{name} = {s}: {m}")))?;
            }
        }
        let s = py.allow_threads(|| dmover_stream::Stream::open(cfg)).map_err(py_err)?;
        Ok(Stream { inner: Some(s) })
    }

    /// Copies the bytes of `data` (any C-contiguous buffer) into the stream.
    fn write(&mut self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<()> {
        // A byte view of the object's own memory: no copy.
        let bytes = PyMemoryView::from(data)?
            .call_method1("cast", ("B",))
            .map_err(|_| PyValueError::new_err("write needs a C-contiguous buffer (numpy.ascontiguousarray makes one)"))?;
        let buf = PyBuffer::<u8>::get(&bytes)?;
        let s = self.open()?;
        if buf.len_bytes() == 0 {
            return Ok(());
        }
        // SAFETY: `buf` keeps the exporter's memory alive and in place until
        // it is dropped, after the write; it is C-contiguous (cast succeeded)
        // and `len_bytes` long.
        let slice = unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) };
        let r = py.allow_threads(|| s.write(slice));
        drop(buf);
        r.map_err(py_err)
    }

    /// Attaches key=value to the current step (the value as `str(value)`).
    fn write_metadata(&mut self, key: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let value = value.str()?.to_string();
        self.open()?.write_metadata(key, &value).map_err(py_err)
    }

    /// Ends the current time step.
    fn end_step(&mut self, py: Python<'_>) -> PyResult<()> {
        let s = self.open()?;
        py.allow_threads(|| s.end_step()).map_err(py_err)
    }

    /// The step being written (0 first).
    #[getter]
    fn step(&self) -> PyResult<u64> {
        self.inner.as_ref().map(|s| s.step()).ok_or_else(|| PyValueError::new_err("the stream is closed"))
    }

    /// Sends everything left, writes the manifest and returns the report
    /// as a dict. Raises `ConnectionError` if blocks were left undelivered.
    fn close<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.take().ok_or_else(|| PyValueError::new_err("the stream is already closed"))?;
        let r = py.allow_threads(|| s.close()).map_err(py_err)?;
        if let Some(e) = r.undelivered() {
            return Err(py_err(e));
        }
        report(py, &r)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Closes the stream (also after an exception: what was written is sent).
    #[pyo3(signature = (*_args))]
    fn __exit__(&mut self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        if self.inner.is_some() {
            self.close(py)?;
        }
        Ok(false)
    }
}

fn report<'py>(py: Python<'py>, r: &Report) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("steps", r.steps)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("blocks", r.blocks)?;
    d.set_item("spilled_blocks", r.spilled_blocks)?;
    d.set_item("spilled_bytes", r.spilled_bytes)?;
    d.set_item("resent_blocks", r.resent_blocks)?;
    d.set_item("failovers", r.failovers)?;
    d.set_item("undelivered_blocks", r.undelivered_blocks)?;
    d.set_item("damaged_blocks", r.damaged.len())?;
    d.set_item("split_steps", r.split_steps.clone())?;
    d.set_item("complete_at", r.complete_at.clone())?;
    d.set_item("max_streams", r.max_streams)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("manifest", r.manifest.as_ref().map(|m| m.display().to_string()))?;
    let dests = r
        .destinations
        .iter()
        .map(|x| {
            let e = PyDict::new(py);
            e.set_item("addr", &x.name)?;
            e.set_item("blocks", x.count)?;
            e.set_item("bytes", x.bytes)?;
            Ok(e)
        })
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("destinations", dests)?;
    Ok(d)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Stream>()?;
    Ok(())
}
