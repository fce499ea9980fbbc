//! Memory-mapped GGUF reader: header, metadata key/values, tensor infos and tensor bytes.
//!
//! The file is mapped once; tensor data is handed out as borrowed byte slices into the map, so
//! loading a model costs no copies. Every length and offset read from the file is checked against
//! the file size before use: a truncated or corrupt file is an error naming what was wrong, never
//! a panic or an out-of-bounds read.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use kvgate_kernels::mmap::Mmap;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Sanity caps so a corrupt header cannot make us allocate absurd amounts of memory.
const MAX_STRING_LEN: u64 = 64 << 20;
const MAX_ARRAY_LEN: u64 = 1 << 26;
/// ggml's `GGML_MAX_DIMS`: llama.cpp refuses a tensor with more dimensions.
const MAX_TENSOR_DIMS: u32 = 4;
/// Largest `general.alignment` accepted. llama.cpp only asks for a power of two, but writers use
/// 32 (gguf-py's default) or 64; a huge value only pads every tensor, and `kvgate quantize`
/// writes that padding into memory (2^31 took 2 GiB for a 300 KB file).
pub const MAX_ALIGNMENT: u64 = 1 << 20;

/// Everything that can go wrong reading a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path}: not a GGUF file: expected it to start with \"GGUF\", found {:?}",
        String::from_utf8_lossy(found)
    )]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{path}: unsupported GGUF version {version} (supported: 2 and 3)")]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{path}: file is truncated or corrupt at byte {offset}: {what}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        what: String,
    },
    #[error(
        "{path}: tensor `{name}` has unsupported type {ty} (supported: F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)"
    )]
    UnsupportedTensorType {
        path: PathBuf,
        name: String,
        ty: String,
    },
    #[error(
        "{path}: tensor `{name}` starts at data offset {offset}, which is not a multiple of the \
         alignment {alignment} (general.alignment)"
    )]
    MisalignedTensor {
        path: PathBuf,
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error("{path}: {reason}")]
    BadAlignment { path: PathBuf, reason: String },
    #[error("{path}: not a regular file")]
    NotAFile { path: PathBuf },
}

/// GGML tensor types. Only the ones kvgate can compute with have their own variant.
#[allow(non_camel_case_types)] // ggml's names, as GGUF tools print them
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q5_0,
    Q5_1,
    Q4_K,
    Q5_K,
    Q6_K,
    /// Any other GGML type id; loading a tensor of this type is an error.
    Other(u32),
}

impl GgmlType {
    fn from_id(id: u32) -> Self {
        match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4_K,
            13 => Self::Q5_K,
            14 => Self::Q6_K,
            other => Self::Other(other),
        }
    }

    /// (elements per block, bytes per block) for the supported types.
    pub fn block_layout(self) -> Option<(u64, u64)> {
        match self {
            Self::F32 => Some((1, 4)),
            Self::F16 => Some((1, 2)),
            Self::Q4_0 => Some((32, 18)),
            Self::Q4_1 => Some((32, 20)),
            Self::Q8_0 => Some((32, 34)),
            Self::Q5_0 => Some((32, 22)),
            Self::Q5_1 => Some((32, 24)),
            Self::Q4_K => Some((256, 144)),
            Self::Q5_K => Some((256, 176)),
            Self::Q6_K => Some((256, 210)),
            Self::Other(_) => None,
        }
    }

    pub fn name(self) -> String {
        match self {
            Self::F32 => "F32".into(),
            Self::F16 => "F16".into(),
            Self::Q4_0 => "Q4_0".into(),
            Self::Q4_1 => "Q4_1".into(),
            Self::Q8_0 => "Q8_0".into(),
            Self::Q5_0 => "Q5_0".into(),
            Self::Q5_1 => "Q5_1".into(),
            Self::Q4_K => "Q4_K".into(),
            Self::Q5_K => "Q5_K".into(),
            Self::Q6_K => "Q6_K".into(),
            Self::Other(id) => format!("ggml type id {id}"),
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// Any integer type that fits a u64 (GGUF writers are not consistent about widths).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Self::F32(v) => Some(v),
            Self::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            Self::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn num_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed, memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    data_start: u64,
    /// `general.alignment` (32 when absent): every tensor offset is a multiple of it.
    alignment: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses `path`. Tensor types and extents are checked here, so later accessors
    /// cannot fail on a file that opened.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        // Before opening: opening a FIFO blocks until a writer comes, and a device such as
        // /dev/zero has no end to map.
        if !std::fs::metadata(&path).map_err(io)?.is_file() {
            return Err(GgufError::NotAFile { path });
        }
        let file = File::open(&path).map_err(io)?;
        // The map is read-only and the file is not expected to change while kvgate runs; a file
        // truncated underneath a running process is outside what any mmap-based loader handles.
        let map = kvgate_kernels::mmap::map_read_only(&file).map_err(io)?;
        Self::parse(path, map)
    }

    fn parse(path: PathBuf, map: Mmap) -> Result<Self, GgufError> {
        let mut r = Reader {
            buf: &map,
            pos: 0,
            path: &path,
        };
        let magic: [u8; 4] = r.bytes(4, "magic")?.try_into().unwrap_or([0; 4]);
        if &magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic { path, found: magic });
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion { path, version });
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        if n_tensors > MAX_ARRAY_LEN || n_kv > MAX_ARRAY_LEN {
            return Err(r.corrupt(format!(
                "implausible counts: {n_tensors} tensors, {n_kv} metadata entries"
            )));
        }

        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            // llama.cpp refuses a repeated key; keeping the last one would let a second
            // `general.architecture` silently change what the file is.
            if metadata.contains_key(&key) {
                return Err(r.corrupt(format!("metadata key `{key}` appears more than once")));
            }
            let ty = r.u32("metadata value type")?;
            let value = r.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }

        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut names = std::collections::HashSet::new();
        for _ in 0..n_tensors {
            let name = r.string("tensor name")?;
            // As llama.cpp: lookups by name would find only one of two tensors of one name.
            if !names.insert(name.clone()) {
                return Err(r.corrupt(format!("tensor `{name}` appears more than once")));
            }
            let n_dims = r.u32("tensor dimension count")?;
            if n_dims == 0 || n_dims > MAX_TENSOR_DIMS {
                return Err(r.corrupt(format!(
                    "tensor `{name}` has {n_dims} dimensions (1 to {MAX_TENSOR_DIMS} allowed)"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let dim = r.u64("tensor dimension")?;
                // A tensor without elements is no weight any model uses, and row counts are
                // divided by its dimensions later (`kvgate quantize` once divided by zero).
                if dim == 0 {
                    return Err(r.corrupt(format!("tensor `{name}` has a dimension of 0")));
                }
                dims.push(dim);
            }
            let ty = GgmlType::from_id(r.u32("tensor type")?);
            let offset = r.u64("tensor offset")?;
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }

        let alignment = match alignment_of(metadata.get("general.alignment")) {
            Ok(alignment) => alignment,
            Err(reason) => return Err(GgufError::BadAlignment { path, reason }),
        };
        let data_start = r.pos.div_ceil(alignment) * alignment;
        let gguf = Self {
            path,
            version,
            metadata,
            tensors,
            data_start,
            alignment,
            map,
        };
        gguf.check_tensor_extents()?;
        Ok(gguf)
    }

    /// Every tensor must have a supported type, start at a multiple of the alignment (as
    /// llama.cpp requires) and lie entirely inside the file.
    fn check_tensor_extents(&self) -> Result<(), GgufError> {
        let file_len = self.map.len() as u64;
        for t in &self.tensors {
            if t.offset % self.alignment != 0 {
                return Err(GgufError::MisalignedTensor {
                    path: self.path.clone(),
                    name: t.name.clone(),
                    offset: t.offset,
                    alignment: self.alignment,
                });
            }
            let Some((block_elems, block_bytes)) = t.ty.block_layout() else {
                return Err(GgufError::UnsupportedTensorType {
                    path: self.path.clone(),
                    name: t.name.clone(),
                    ty: t.ty.name(),
                });
            };
            let elems = t
                .dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| self.corrupt(0, format!("tensor `{}` size overflows", t.name)))?;
            if t.dims[0] % block_elems != 0 {
                return Err(self.corrupt(
                    0,
                    format!(
                        "tensor `{}` row length {} is not a multiple of the {} block size {block_elems}",
                        t.name,
                        t.dims[0],
                        t.ty.name()
                    ),
                ));
            }
            let bytes = (elems / block_elems)
                .checked_mul(block_bytes)
                .ok_or_else(|| self.corrupt(0, format!("tensor `{}` size overflows", t.name)))?;
            let start = self.data_start.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(bytes));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(self.corrupt(
                        file_len,
                        format!(
                            "tensor `{}` ({bytes} bytes at data offset {}) extends past the end of the file",
                            t.name, t.offset
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn corrupt(&self, offset: u64, what: String) -> GgufError {
        GgufError::Corrupt {
            path: self.path.clone(),
            offset,
            what,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole mapped file.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Size of the mapped file in bytes.
    pub fn file_len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(MetaValue::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(MetaValue::as_u64)
    }

    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key).and_then(MetaValue::as_f32)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(MetaValue::as_bool)
    }

    /// A string array, e.g. `tokenizer.ggml.tokens`. `None` if absent or not all strings.
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(MetaValue::as_str)
            .collect()
    }

    /// An integer array, e.g. `tokenizer.ggml.token_type`.
    pub fn get_i64_array(&self, key: &str) -> Option<Vec<i64>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(MetaValue::as_i64)
            .collect()
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of a tensor (bounds were checked when the file was opened).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let (block_elems, block_bytes) = info.ty.block_layout().unwrap_or((1, 0));
        let len = info.num_elements() / block_elems * block_bytes;
        let start = (self.data_start + info.offset) as usize;
        &self.map[start..start + len as usize]
    }

    /// Total bytes of tensor data (what the weights occupy in memory).
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| self.tensor_data(t).len() as u64)
            .sum()
    }
}

/// `general.alignment` (32 when absent), stored in any integer width (writers differ). llama.cpp
/// refuses one that is not a power of two rather than guessing; above [`MAX_ALIGNMENT`] is
/// refused too. The loader and `kvgate quantize` both read it here, so they cannot disagree
/// about where tensor data starts.
pub fn alignment_of(value: Option<&MetaValue>) -> Result<u64, String> {
    let Some(value) = value else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    match value.as_u64() {
        Some(a) if a.is_power_of_two() && a <= MAX_ALIGNMENT => Ok(a),
        Some(a) if a.is_power_of_two() => Err(format!(
            "general.alignment is {a}; at most {MAX_ALIGNMENT} is accepted"
        )),
        _ => {
            let shown = match value.as_i64() {
                Some(v) => v.to_string(),
                None => format!("{value:?}").chars().take(40).collect(),
            };
            Err(format!(
                "general.alignment is {shown}; it must be a power of two"
            ))
        }
    }
}

/// One metadata value of GGUF type `ty` decoded from `bytes` (for readers that skip over the
/// values they do not need, such as `kvgate quantize`); `None` if the bytes do not hold one.
pub(crate) fn decode_value(ty: u32, bytes: &[u8]) -> Option<MetaValue> {
    let mut r = Reader {
        buf: bytes,
        pos: 0,
        path: Path::new(""),
    };
    r.value(ty, "", 0).ok()
}

/// Bounds-checked little-endian cursor over the mapped header.
struct Reader<'a> {
    buf: &'a [u8],
    pos: u64,
    path: &'a Path,
}

impl Reader<'_> {
    fn corrupt(&self, what: String) -> GgufError {
        GgufError::Corrupt {
            path: self.path.to_path_buf(),
            offset: self.pos,
            what,
        }
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<&[u8], GgufError> {
        let start = self.pos;
        let end = start
            .checked_add(n)
            .filter(|&e| e <= self.buf.len() as u64)
            .ok_or_else(|| self.corrupt(format!("unexpected end of file reading {what}")))?;
        self.pos = end;
        Ok(&self.buf[start as usize..end as usize])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let b = self.bytes(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > MAX_STRING_LEN {
            return Err(self.corrupt(format!("{what} claims {len} bytes")));
        }
        let bytes = self.bytes(len, what)?.to_vec();
        String::from_utf8(bytes).map_err(|_| self.corrupt(format!("{what} is not valid UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<MetaValue, GgufError> {
        let what = format!("value of `{key}`");
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(&what)?[0]),
            1 => MetaValue::I8(self.array::<1>(&what)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => MetaValue::Bool(self.array::<1>(&what)?[0] != 0),
            8 => MetaValue::String(self.string(&what)?),
            9 => {
                if depth > 2 {
                    return Err(self.corrupt(format!("`{key}` nests arrays too deeply")));
                }
                let elem_ty = self.u32(&what)?;
                let len = self.u64(&what)?;
                if len > MAX_ARRAY_LEN {
                    return Err(self.corrupt(format!("`{key}` claims {len} elements")));
                }
                let mut items = Vec::with_capacity(len.min(1 << 20) as usize);
                for _ in 0..len {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(u64::from_le_bytes(self.array(&what)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(&what)?)),
            other => return Err(self.corrupt(format!("`{key}` has unknown value type {other}"))),
        })
    }
}

/// Writes small GGUF files for tests (here and in other modules' tests).
#[cfg(test)]
pub(crate) mod testutil {
    pub struct GgufBuilder {
        /// (key, its record: key, type and value bytes), in the order first written.
        kv: Vec<(String, Vec<u8>)>,
        /// Write a key set twice twice (to test that files doing so are refused); otherwise
        /// setting a key again replaces its value, as tests that alter one base file expect.
        repeat_keys: bool,
        tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
        /// (tensor index, offset written in its directory entry instead of the real one).
        offset_overrides: Vec<(usize, u64)>,
        /// Padding of the header and of each tensor's data (32 unless [`Self::padded_to`]).
        align: u64,
    }

    impl GgufBuilder {
        pub fn new() -> Self {
            Self {
                kv: Vec::new(),
                repeat_keys: false,
                tensors: Vec::new(),
                offset_overrides: Vec::new(),
                align: 32,
            }
        }

        /// Pads the header and each tensor's data to `align` bytes (write the matching
        /// `general.alignment` too).
        pub fn padded_to(mut self, align: u64) -> Self {
            self.align = align;
            self
        }

        /// Writes `offset` as tensor `index`'s data offset (the data stays where it was).
        pub fn offset_of(mut self, index: usize, offset: u64) -> Self {
            self.offset_overrides.push((index, offset));
            self
        }

        /// Keeps every key set more than once instead of replacing its value.
        pub fn repeat_keys(mut self) -> Self {
            self.repeat_keys = true;
            self
        }

        fn key(&mut self, key: &str, ty: u32) {
            let mut record = Vec::new();
            record.extend((key.len() as u64).to_le_bytes());
            record.extend(key.as_bytes());
            record.extend(ty.to_le_bytes());
            self.kv.push((key.to_owned(), record));
        }

        /// The record of the key written last, for its value bytes.
        fn value(&mut self) -> &mut Vec<u8> {
            &mut self.kv.last_mut().expect("a key first").1
        }

        pub fn u32(mut self, key: &str, v: u32) -> Self {
            self.key(key, 4);
            self.value().extend(v.to_le_bytes());
            self
        }

        pub fn u64(mut self, key: &str, v: u64) -> Self {
            self.key(key, 10);
            self.value().extend(v.to_le_bytes());
            self
        }

        pub fn f32(mut self, key: &str, v: f32) -> Self {
            self.key(key, 6);
            self.value().extend(v.to_le_bytes());
            self
        }

        pub fn bool(mut self, key: &str, v: bool) -> Self {
            self.key(key, 7);
            self.value().push(u8::from(v));
            self
        }

        /// An array of i32 (type 5), e.g. `tokenizer.ggml.token_type`.
        pub fn i32_array(self, key: &str, items: &[i32]) -> Self {
            self.number_array(key, 5, items.iter().map(|v| v.to_le_bytes()))
        }

        /// An array of f32 (type 6), e.g. `tokenizer.ggml.scores`.
        pub fn f32_array(self, key: &str, items: &[f32]) -> Self {
            self.number_array(key, 6, items.iter().map(|v| v.to_le_bytes()))
        }

        fn number_array<const N: usize>(
            mut self,
            key: &str,
            elem_ty: u32,
            items: impl ExactSizeIterator<Item = [u8; N]>,
        ) -> Self {
            self.key(key, 9);
            self.value().extend(elem_ty.to_le_bytes());
            self.value().extend((items.len() as u64).to_le_bytes());
            for bytes in items {
                self.value().extend(bytes);
            }
            self
        }

        pub fn str(mut self, key: &str, v: &str) -> Self {
            self.key(key, 8);
            self.value().extend((v.len() as u64).to_le_bytes());
            self.value().extend(v.as_bytes());
            self
        }

        pub fn str_array(mut self, key: &str, items: &[&str]) -> Self {
            self.key(key, 9);
            self.value().extend(8u32.to_le_bytes());
            self.value().extend((items.len() as u64).to_le_bytes());
            for s in items {
                self.value().extend((s.len() as u64).to_le_bytes());
                self.value().extend(s.as_bytes());
            }
            self
        }

        pub fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
            self.tensors.push((name.into(), dims.to_vec(), ty, data));
            self
        }

        pub fn build(self) -> Vec<u8> {
            let mut out = Vec::new();
            out.extend(b"GGUF");
            out.extend(3u32.to_le_bytes());
            out.extend((self.tensors.len() as u64).to_le_bytes());
            let mut records: Vec<(String, Vec<u8>)> = Vec::new();
            for (key, record) in self.kv.iter().cloned() {
                match records.iter_mut().find(|(k, _)| *k == key) {
                    Some(earlier) if !self.repeat_keys => earlier.1 = record,
                    _ => records.push((key, record)),
                }
            }
            out.extend((records.len() as u64).to_le_bytes());
            for (_, record) in &records {
                out.extend(record);
            }
            let mut offset = 0u64;
            for (index, (name, dims, ty, data)) in self.tensors.iter().enumerate() {
                out.extend((name.len() as u64).to_le_bytes());
                out.extend(name.as_bytes());
                out.extend((dims.len() as u32).to_le_bytes());
                for d in dims {
                    out.extend(d.to_le_bytes());
                }
                out.extend(ty.to_le_bytes());
                let written = self
                    .offset_overrides
                    .iter()
                    .rfind(|(i, _)| *i == index)
                    .map_or(offset, |(_, o)| *o);
                out.extend(written.to_le_bytes());
                offset += (data.len() as u64).div_ceil(self.align) * self.align;
            }
            while !(out.len() as u64).is_multiple_of(self.align) {
                out.push(0);
            }
            // Offsets above were assigned in order with the same padding, which is what
            // appending each tensor and padding reproduces.
            for (_, _, _, data) in &self.tensors {
                out.extend(data);
                while !(out.len() as u64).is_multiple_of(self.align) {
                    out.push(0);
                }
            }
            out
        }
    }

    /// A new empty file `kvgate-runtime-test-XXXXXX-NAME` under the system temp dir, deleted
    /// when the returned guard drops (on a panic too), so a test run leaves nothing behind:
    /// keep the guard while the file is used. NAME comes last so that messages naming the file
    /// still show it, and the random part gives every call its own file: rewriting a file that
    /// another test has memory-mapped would crash it. Deleting a mapped file is safe on Unix
    /// (the mapping keeps the data), so a guard may drop once the file is open.
    pub fn temp_path(name: &str) -> tempfile::TempPath {
        tempfile::Builder::new()
            .prefix("kvgate-runtime-test-")
            .suffix(&format!("-{name}"))
            .tempfile()
            .expect("create a temp file")
            .into_temp_path()
    }

    /// [`temp_path`] holding `bytes`.
    pub fn write_temp(name: &str, bytes: &[u8]) -> tempfile::TempPath {
        let path = temp_path(name);
        std::fs::write(&path, bytes).expect("write a temp file");
        path
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::{GgufBuilder, write_temp};
    use super::*;

    fn sample() -> Vec<u8> {
        let f32s: Vec<u8> = (0..64).flat_map(|i| (i as f32).to_le_bytes()).collect();
        GgufBuilder::new()
            .str("general.architecture", "llama")
            .u32("llama.block_count", 2)
            .f32("llama.rope.freq_base", 10000.0)
            .str_array("tokenizer.ggml.tokens", &["a", "b", "ab"])
            .tensor("w", &[32, 2], 0, f32s)
            .build()
    }

    #[test]
    fn reads_metadata_and_tensors() {
        let path = write_temp("ok.gguf", &sample());
        let g = GgufFile::open(&path).expect("valid file opens");
        assert_eq!(g.get_str("general.architecture"), Some("llama"));
        assert_eq!(g.get_u64("llama.block_count"), Some(2));
        assert_eq!(g.get_f32("llama.rope.freq_base"), Some(10000.0));
        assert_eq!(
            g.get_str_array("tokenizer.ggml.tokens"),
            Some(vec!["a", "b", "ab"])
        );
        let t = g.tensor("w").expect("tensor present");
        assert_eq!(t.ty, GgmlType::F32);
        let data = g.tensor_data(t);
        assert_eq!(data.len(), 64 * 4);
        assert_eq!(f32::from_le_bytes(data[4..8].try_into().unwrap()), 1.0);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample();
        for cut in [0, 3, 4, 8, 20, 40, bytes.len() / 2, bytes.len() - 1] {
            let path = write_temp(&format!("cut{cut}.gguf"), &bytes[..cut]);
            let err = GgufFile::open(&path).expect_err("truncated file must not open");
            let msg = err.to_string();
            assert!(
                msg.contains("truncated") || msg.contains("not a GGUF"),
                "cut at {cut}: {msg}"
            );
        }
    }

    #[test]
    fn unsupported_tensor_type_is_named() {
        let bytes = GgufBuilder::new()
            .tensor("blk.0.attn_q.weight", &[256, 1], 16, vec![0; 66])
            .build();
        let path = write_temp("iq2.gguf", &bytes);
        let err = GgufFile::open(&path).expect_err("IQ2_XXS is not supported");
        let msg = err.to_string();
        assert!(
            msg.contains("blk.0.attn_q.weight") && msg.contains("16") && msg.contains("Q6_K"),
            "{msg}"
        );
    }

    #[test]
    fn k_quant_tensors_open_with_their_block_sizes() {
        // Two rows of 256: one super-block each (Q4_K 144, Q5_K 176, Q6_K 210 bytes).
        for (id, ty, bytes) in [
            (12, GgmlType::Q4_K, 144),
            (13, GgmlType::Q5_K, 176),
            (14, GgmlType::Q6_K, 210),
        ] {
            let built = GgufBuilder::new()
                .tensor("w", &[256, 2], id, vec![0; 2 * bytes])
                .build();
            let gguf = GgufFile::open(write_temp(&format!("k{id}.gguf"), &built)).expect("opens");
            let t = gguf.tensor("w").expect("tensor");
            assert_eq!((t.ty, gguf.tensor_data(t).len()), (ty, 2 * bytes));
            // Three rows claimed, two stored: the extent check must use the K block size.
            let short = GgufBuilder::new()
                .tensor("w", &[256, 3], id, vec![0; 2 * bytes])
                .build();
            assert!(GgufFile::open(write_temp(&format!("ks{id}.gguf"), &short)).is_err());
        }
    }

    #[test]
    fn wrong_magic_and_version_are_named() {
        let path = write_temp("magic.gguf", b"GGML\x03\0\0\0");
        let err = GgufFile::open(&path).expect_err("GGML is not GGUF");
        assert!(matches!(err, GgufError::BadMagic { .. }));
        assert!(
            err.to_string()
                .ends_with("not a GGUF file: expected it to start with \"GGUF\", found \"GGML\""),
            "{err}"
        );
        let mut bytes = sample();
        bytes[4] = 9;
        let path = write_temp("ver.gguf", &bytes);
        assert!(matches!(
            GgufFile::open(&path),
            Err(GgufError::UnsupportedVersion { version: 9, .. })
        ));
    }

    #[test]
    fn misaligned_tensor_offsets_are_refused_naming_tensor_offset_and_alignment() {
        let f32s = |n: usize| vec![0u8; n * 4];
        let two = |b: GgufBuilder| {
            b.tensor("a", &[8], 0, f32s(8))
                .tensor("token_embd.weight", &[8, 2], 0, f32s(16))
        };
        // Aligned (a at 0, token_embd.weight at 32) opens; at 3 or 16 it does not.
        GgufFile::open(write_temp("aligned.gguf", &two(GgufBuilder::new()).build()))
            .expect("aligned offsets open");
        for offset in [3u64, 16] {
            let bytes = two(GgufBuilder::new()).offset_of(1, offset).build();
            let path = write_temp(&format!("misaligned{offset}.gguf"), &bytes);
            let err = GgufFile::open(&path).expect_err("misaligned offset is refused");
            let msg = err.to_string();
            assert!(
                matches!(err, GgufError::MisalignedTensor { alignment: 32, .. })
                    && msg.contains("`token_embd.weight`")
                    && msg.contains(&format!("data offset {offset},"))
                    && msg.contains("alignment 32")
                    && !msg.contains('\n'),
                "{msg}"
            );
        }
        // general.alignment = 16 makes 16 valid (tensor data still lies inside the file).
        let bytes = two(GgufBuilder::new().u32("general.alignment", 16))
            .offset_of(1, 16)
            .build();
        GgufFile::open(write_temp("align16.gguf", &bytes)).expect("16 is a multiple of 16");
        // An alignment that is not a power of two is refused, not replaced by 32.
        let bytes = two(GgufBuilder::new().u32("general.alignment", 24)).build();
        let err = GgufFile::open(write_temp("align24.gguf", &bytes)).expect_err("24 refused");
        assert!(err.to_string().contains("general.alignment is 24"), "{err}");
    }

    /// The error text of opening `bytes` written as `name`.
    fn open_error(name: &str, bytes: &[u8]) -> String {
        let err = GgufFile::open(write_temp(name, bytes)).expect_err(name);
        let msg = err.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        msg
    }

    #[test]
    fn a_tensor_whose_byte_size_overflows_is_refused_naming_it() {
        // 2^62 F32 elements: the element count fits a u64, its 2^64 bytes do not.
        let bytes = GgufBuilder::new()
            .tensor("blk.0.attn_norm.weight", &[1 << 62], 0, vec![0; 32])
            .build();
        let msg = open_error("overflow.gguf", &bytes);
        assert!(
            msg.contains("tensor `blk.0.attn_norm.weight` size overflows"),
            "{msg}"
        );
    }

    #[test]
    fn zero_dimensions_and_more_than_four_are_refused_as_llama_cpp_does() {
        let bytes = GgufBuilder::new().tensor("w", &[0], 0, Vec::new()).build();
        let msg = open_error("dim0.gguf", &bytes);
        assert!(msg.contains("tensor `w` has a dimension of 0"), "{msg}");
        let bytes = GgufBuilder::new()
            .tensor("w", &[32, 1, 0, 1], 0, Vec::new())
            .build();
        assert!(open_error("dim2.gguf", &bytes).contains("a dimension of 0"));
        let bytes = GgufBuilder::new()
            .tensor("w", &[8, 1, 1, 1, 1], 0, vec![0; 32])
            .build();
        let msg = open_error("dims5.gguf", &bytes);
        assert!(
            msg.contains("tensor `w` has 5 dimensions (1 to 4 allowed)"),
            "{msg}"
        );
        let four = GgufBuilder::new()
            .tensor("w", &[8, 1, 1, 1], 0, vec![0; 32])
            .build();
        GgufFile::open(write_temp("dims4.gguf", &four)).expect("4 dimensions open");
    }

    #[test]
    fn repeated_tensor_names_and_metadata_keys_are_refused_naming_them() {
        let bytes = GgufBuilder::new()
            .tensor("w", &[8], 0, vec![0; 32])
            .tensor("w", &[8], 0, vec![0; 32])
            .build();
        let msg = open_error("dup-tensor.gguf", &bytes);
        assert!(msg.contains("tensor `w` appears more than once"), "{msg}");
        let bytes = GgufBuilder::new()
            .repeat_keys()
            .str("general.architecture", "llama")
            .str("general.architecture", "qwen2")
            .build();
        let msg = open_error("dup-key.gguf", &bytes);
        assert!(
            msg.contains("metadata key `general.architecture` appears more than once"),
            "{msg}"
        );
    }

    #[test]
    fn alignment_is_read_from_any_integer_width_and_capped() {
        let f32s = vec![0u8; 8 * 4];
        let bytes = GgufBuilder::new()
            .u64("general.alignment", 32)
            .tensor("w", &[8], 0, f32s.clone())
            .build();
        let gguf = GgufFile::open(write_temp("align-u64.gguf", &bytes)).expect("u64 32 opens");
        assert_eq!(gguf.alignment, 32);
        assert_eq!(
            alignment_of(Some(&MetaValue::U64(64))),
            Ok(64),
            "as the loader reads it"
        );
        assert_eq!(alignment_of(Some(&MetaValue::U32(1 << 20))), Ok(1 << 20));
        assert_eq!(alignment_of(None), Ok(32));
        let bytes = GgufBuilder::new()
            .u32("general.alignment", 1 << 31)
            .tensor("w", &[8], 0, f32s)
            .build();
        let msg = open_error("align-huge.gguf", &bytes);
        assert!(
            msg.ends_with("general.alignment is 2147483648; at most 1048576 is accepted"),
            "{msg}"
        );
        let msg = alignment_of(Some(&MetaValue::I32(-32))).unwrap_err();
        assert_eq!(msg, "general.alignment is -32; it must be a power of two");
    }

    #[test]
    fn a_path_that_is_not_a_regular_file_is_refused_without_reading_it() {
        for path in [Path::new("/dev/zero"), &std::env::temp_dir()] {
            let err = GgufFile::open(path).expect_err("not a file");
            assert!(matches!(err, GgufError::NotAFile { .. }), "{err}");
            assert_eq!(
                err.to_string(),
                format!("{}: not a regular file", path.display())
            );
        }
    }
}
