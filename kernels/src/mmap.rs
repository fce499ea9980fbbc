//! Read-only memory mapping of model files. Mapping is `unsafe` (another process could truncate
//! or modify the file underneath), and kvgate keeps all `unsafe` in this crate; the runtime,
//! which forbids unsafe code, maps GGUF files through here.

pub use memmap2::Mmap;

/// Maps `file` read-only. The caller must not expect coherent data if the file is modified or
/// truncated while mapped; model files are treated as immutable while kvgate runs.
pub fn map_read_only(file: &std::fs::File) -> std::io::Result<Mmap> {
    // SAFETY: the mapping is read-only and the file is treated as immutable for its lifetime;
    // concurrent external modification is outside the supported configuration (documented above).
    unsafe { Mmap::map(file) }
}
