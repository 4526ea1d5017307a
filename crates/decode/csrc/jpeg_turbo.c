/*
 * JPEG decoding with libjpeg-turbo's libjpeg API (Debian: libjpeg62-turbo-dev),
 * the library and the defaults Pillow decodes with (accurate integer IDCT,
 * fancy upsampling), so stoker's pixels equal `np.asarray(Image.open(..))`.
 *
 * libjpeg reports errors by calling `error_exit`, which must not return: it
 * longjmps back to the entry point here. The jump crosses only this file's
 * and libjpeg's C frames, never Rust frames. Warnings (corrupt but decodable
 * data) are ignored as Pillow ignores them, and never printed.
 *
 * Scaling: `denom` 1, 2, 4 or 8 decodes at 1/denom of the size in the DCT
 * domain (libjpeg's scale_num/scale_denom; output side ceil(side / denom)).
 * Region: rows [top, top + height) and columns [left, left + width) of the
 * (scaled) output, decoded with jpeg_crop_scanline / jpeg_skip_scanlines, so
 * the rows and iMCU columns outside it are never inverse-transformed.
 */
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

/* A progressive JPEG may hold any number of scans, each a full pass over the
 * coefficients: past this many (libjpeg-turbo's own TJFLAG_LIMITSCANS bound)
 * the file is refused rather than decoded for minutes. */
#define MAX_SCANS 500

struct guard {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char *msg;
    size_t msg_len;
};

static void on_error(j_common_ptr cinfo) {
    struct guard *g = (struct guard *)cinfo->err;
    if (g->msg && g->msg_len > 0) {
        char text[JMSG_LENGTH_MAX];
        (*cinfo->err->format_message)(cinfo, text);
        snprintf(g->msg, g->msg_len, "%s", text);
    }
    longjmp(g->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    (void)cinfo;
    (void)level; /* warnings and trace messages: not printed, not fatal */
}

static void on_progress(j_common_ptr cinfo) {
    j_decompress_ptr d = (j_decompress_ptr)cinfo;
    if (d->is_decompressor && d->input_scan_number > MAX_SCANS) {
        struct guard *g = (struct guard *)cinfo->err;
        snprintf(g->msg, g->msg_len, "more than %d progressive scans", MAX_SCANS);
        longjmp(g->jump, 1);
    }
}

/* Output channels: 1 for grayscale, 3 (RGB) for everything else. */
static int out_channels(j_decompress_ptr d) {
    return d->jpeg_color_space == JCS_GRAYSCALE ? 1 : 3;
}

static void set_output(j_decompress_ptr d, int denom) {
    switch (d->jpeg_color_space) {
    case JCS_GRAYSCALE: d->out_color_space = JCS_GRAYSCALE; break;
    case JCS_CMYK:
    case JCS_YCCK: d->out_color_space = JCS_CMYK; break;
    default: d->out_color_space = JCS_RGB; break;
    }
    d->scale_num = 1;
    d->scale_denom = (unsigned int)denom;
}

/* CMYK → RGB as Pillow's `convert("RGB")` does: Adobe files store inverted
 * CMYK (Pillow reads them as "CMYK;I"); R = (255 - K) - (255 - K) * C / 255. */
static void cmyk_to_rgb(const uint8_t *in, uint8_t *out, size_t pixels, int inverted) {
    for (size_t i = 0; i < pixels; i++) {
        unsigned k = inverted ? in[4 * i + 3] : 255u - in[4 * i + 3];
        for (int c = 0; c < 3; c++) {
            unsigned v = inverted ? 255u - in[4 * i + c] : in[4 * i + c];
            unsigned t = v * k + 128;
            out[3 * i + c] = (uint8_t)(k - (((t >> 8) + t) >> 8));
        }
    }
}

/* Reads the header; writes the output size at scale 1/denom and the channel count. */
int stoker_jpeg_header(const uint8_t *data, size_t len, int denom, uint32_t *width, uint32_t *height,
                       uint32_t *channels, char *msg, size_t msg_len) {
    struct jpeg_decompress_struct d;
    struct guard g;
    memset(&d, 0, sizeof d);
    d.err = jpeg_std_error(&g.pub);
    g.pub.error_exit = on_error;
    g.pub.emit_message = on_message;
    g.msg = msg;
    g.msg_len = msg_len;
    if (setjmp(g.jump)) {
        jpeg_destroy_decompress(&d);
        return -1;
    }
    jpeg_create_decompress(&d);
    jpeg_mem_src(&d, data, (unsigned long)len);
    jpeg_read_header(&d, TRUE);
    set_output(&d, denom);
    jpeg_calc_output_dimensions(&d);
    *width = d.output_width;
    *height = d.output_height;
    *channels = (uint32_t)out_channels(&d);
    jpeg_destroy_decompress(&d);
    return 0;
}

/*
 * Decodes the region (`left`, `top`, `width`, `height`) of the image scaled
 * to 1/`denom` into `dst` (`height` rows of `width * channels` bytes).
 * `row` is scratch of at least `row_len` bytes: 4 × the scaled image width.
 * Returns 0, or -1 with a message (nothing else is promised about `dst`).
 */
int stoker_jpeg_decode(const uint8_t *data, size_t len, int denom, uint32_t left, uint32_t top, uint32_t width,
                       uint32_t height, uint32_t channels, uint8_t *dst, size_t dst_len, uint8_t *row,
                       size_t row_len, char *msg, size_t msg_len) {
    struct jpeg_decompress_struct d;
    struct jpeg_progress_mgr progress;
    struct guard g;
    memset(&d, 0, sizeof d);
    d.err = jpeg_std_error(&g.pub);
    g.pub.error_exit = on_error;
    g.pub.emit_message = on_message;
    g.msg = msg;
    g.msg_len = msg_len;
    if (setjmp(g.jump)) {
        jpeg_destroy_decompress(&d);
        return -1;
    }
    jpeg_create_decompress(&d);
    progress.progress_monitor = on_progress;
    d.progress = &progress;
    jpeg_mem_src(&d, data, (unsigned long)len);
    jpeg_read_header(&d, TRUE);
    set_output(&d, denom);
    jpeg_calc_output_dimensions(&d);
    if ((uint32_t)out_channels(&d) != channels || (uint64_t)left + width > d.output_width ||
        (uint64_t)top + height > d.output_height || width == 0 || height == 0 ||
        (uint64_t)width * height * channels != dst_len || row_len < 4 * (size_t)d.output_width) {
        snprintf(msg, msg_len, "region %ux%u+%u+%u of %u channels does not fit the %ux%u image", width, height,
                 left, top, channels, d.output_width, d.output_height);
        jpeg_destroy_decompress(&d);
        return -1;
    }
    jpeg_start_decompress(&d);
    JDIMENSION x = left, w = width;
    if (x != 0 || w != d.output_width) {
        /* One iMCU of margin each side: fancy chroma upsampling treats the
         * crop's edges as image edges, so pixels next to them would differ
         * from the full decode's (seen with 4:2:2 at 1/4 scale). */
        JDIMENSION margin = (JDIMENSION)(d.max_h_samp_factor * d.min_DCT_scaled_size);
        x = left > margin ? left - margin : 0;
        JDIMENSION end = left + width + margin < d.output_width ? left + width + margin : d.output_width;
        w = end - x;
        jpeg_crop_scanline(&d, &x, &w); /* widens to iMCU boundaries */
    }
    size_t shift = (size_t)(left - x) * (size_t)d.output_components;
    if (top > 0) {
        jpeg_skip_scanlines(&d, top);
    }
    int cmyk = d.out_color_space == JCS_CMYK;
    int direct = !cmyk && shift == 0 && w == width;
    size_t out_row = (size_t)width * channels;
    for (uint32_t y = 0; y < height; y++) {
        uint8_t *target = dst + (size_t)y * out_row;
        JSAMPROW rows[1] = {direct ? target : row};
        if (jpeg_read_scanlines(&d, rows, 1) != 1) {
            /* the memory source never suspends: no scanline is an error */
            snprintf(msg, msg_len, "decoder returned no scanline");
            jpeg_destroy_decompress(&d);
            return -1;
        }
        if (cmyk) {
            cmyk_to_rgb(row + shift, target, width, d.saw_Adobe_marker);
        } else if (!direct) {
            memcpy(target, row + shift, out_row);
        }
    }
    /* Rows below the region are never decoded: abort, not finish. */
    jpeg_destroy_decompress(&d);
    return 0;
}
