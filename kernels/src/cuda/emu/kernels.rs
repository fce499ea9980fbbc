//! The emulator library's entry points (`EMU_LAUNCHER` in kernels/cuda/emu/launchers.cpp), one
//! safe method each: the tests pass buffers they sized for the launch.

use super::Launch;
use std::path::Path;

macro_rules! emu_kernels {
    ($($name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {
        /// The loaded library and its entry points.
        pub struct Emu {
            _lib: libloading::Library,
            $($name: unsafe extern "C" fn(*const Launch, $($ty),*),)*
        }

        impl Emu {
            pub fn load(path: &Path) -> Emu {
                // SAFETY: the library is the emulator built from this repository's sources;
                // loading it runs only C++ static initialisers.
                let lib = unsafe { libloading::Library::new(path) }
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                $(
                    // SAFETY: the symbol is declared with this exact C signature by
                    // EMU_LAUNCHER in launchers.cpp.
                    let $name = unsafe {
                        *lib.get::<unsafe extern "C" fn(*const Launch, $($ty),*)>(
                            concat!("emu_", stringify!($name), "\0").as_bytes(),
                        )
                        .unwrap_or_else(|e| panic!("emu_{}: {e}", stringify!($name)))
                    };
                )*
                Emu { _lib: lib, $($name,)* }
            }

            $(
                #[allow(clippy::too_many_arguments)]
                pub fn $name(&self, launch: Launch, $($arg: $ty),*) {
                    // SAFETY: the tests size every buffer for the launch they describe.
                    unsafe { (self.$name)(&launch, $($arg),*) }
                }
            )*
        }
    };
}

emu_kernels! {
    embed_rows(out: *mut f32, table: *const u8, ids: *const i32, ty: i32, cols: i32, row_bytes: i64);
    dequantize_f16(out: *mut u16, w: *const u8, ty: i32, cols: i32, row_bytes: i64, n_elems: i64);
    rms_norm(out: *mut f32, x: *const f32, w: *const f32, n: i32, eps: f32);
    rope_norm(x: *mut f32, positions: *const i32, n_heads: i32, head_dim: i32, rope_dim: i32, freq_base: f32);
    swiglu(out: *mut f32, gate: *const f32, up: *const f32, n: i64);
    add_inplace(x: *mut f32, y: *const f32, n: i64);
    argmax_rows(out: *mut i32, logits: *const f32, vocab: i32);
    write_kv(k_cache: *mut u16, v_cache: *mut u16, k: *const f32, v: *const f32, slots: *const i32, n_kv_heads: i32, head_dim: i32);
    paged_attention_d32(out: *mut f32, part_out: *mut f32, part_stats: *mut f32, q: *const f32, k_cache: *const u16, v_cache: *const u16, block_tables: *const i32, row_seq: *const i32, row_ctx: *const i32, max_blocks_per_seq: i32, n_kv_heads: i32, group: i32, max_parts: i32, scale: f32);
    paged_attention_d64(out: *mut f32, part_out: *mut f32, part_stats: *mut f32, q: *const f32, k_cache: *const u16, v_cache: *const u16, block_tables: *const i32, row_seq: *const i32, row_ctx: *const i32, max_blocks_per_seq: i32, n_kv_heads: i32, group: i32, max_parts: i32, scale: f32);
    paged_attention_d128(out: *mut f32, part_out: *mut f32, part_stats: *mut f32, q: *const f32, k_cache: *const u16, v_cache: *const u16, block_tables: *const i32, row_seq: *const i32, row_ctx: *const i32, max_blocks_per_seq: i32, n_kv_heads: i32, group: i32, max_parts: i32, scale: f32);
    paged_attention_tiled_d32(out: *mut f32, part_out: *mut f32, part_stats: *mut f32, q: *const f32, k_cache: *const u16, v_cache: *const u16, block_tables: *const i32, row_seq: *const i32, row_ctx: *const i32, tiles: *const i32, max_blocks_per_seq: i32, n_kv_heads: i32, group: i32, max_parts: i32, scale: f32);
    paged_attention_tiled_d64(out: *mut f32, part_out: *mut f32, part_stats: *mut f32, q: *const f32, k_cache: *const u16, v_cache: *const u16, block_tables: *const i32, row_seq: *const i32, row_ctx: *const i32, tiles: *const i32, max_blocks_per_seq: i32, n_kv_heads: i32, group: i32, max_parts: i32, scale: f32);
    paged_attention_tiled_d128(out: *mut f32, part_out: *mut f32, part_stats: *mut f32, q: *const f32, k_cache: *const u16, v_cache: *const u16, block_tables: *const i32, row_seq: *const i32, row_ctx: *const i32, tiles: *const i32, max_blocks_per_seq: i32, n_kv_heads: i32, group: i32, max_parts: i32, scale: f32);
    attention_reduce(out: *mut f32, part_out: *const f32, part_stats: *const f32, row_ctx: *const i32, n_heads: i32, head_dim: i32, max_parts: i32);
    quantize_q8_1(out: *mut u8, x: *const f32, n_blocks: i64);
    matvec_q4_0(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    matvec_q4_1(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    matvec_q5_0(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    matvec_q5_1(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    matvec_q8_0(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    matvec_q4_k(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    matvec_q5_k(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    matvec_q6_k(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    mmq_q4_0(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    mmq_q4_1(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    mmq_q5_0(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    mmq_q5_1(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    mmq_q8_0(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    mmq_q4_k(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    mmq_q5_k(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    mmq_q6_k(out: *mut f32, w: *const u8, x: *const u8, rows: i32, cols: i32, batch: i32);
    matvec_f16(out: *mut f32, w: *const u16, x: *const f32, rows: i32, cols: i32, batch: i32);
    mm_f16(out: *mut f32, w: *const u16, x: *const f32, rows: i32, cols: i32, batch: i32);
}
