//! Transform tests against hand-computed values (and Pillow's bilinear resize).

use std::path::Path;

use stoker_proto::DType;

use super::*;

const KEY: SampleKey = SampleKey { seed: 7, epoch: 3, index: 11 };

fn key(index: u64) -> SampleKey {
    SampleKey { index, ..KEY }
}

/// `h × w × c` uint8 pixels with value `f(y, x, ch)`.
fn image(h: usize, w: usize, c: usize, f: impl Fn(usize, usize, usize) -> u8) -> Vec<u8> {
    let mut v = Vec::with_capacity(h * w * c);
    for y in 0..h {
        for x in 0..w {
            for ch in 0..c {
                v.push(f(y, x, ch));
            }
        }
    }
    v
}

fn run(chain: &Chain, input: &[u8], dtype: DType, shape: &[u64], key: SampleKey) -> Vec<u8> {
    run_paired(chain, input, dtype, shape, key, None)
}

fn run_paired(
    chain: &Chain,
    input: &[u8],
    dtype: DType,
    shape: &[u64],
    key: SampleKey,
    leader: Option<&[u64]>,
) -> Vec<u8> {
    let known: Vec<Option<u64>> = shape.iter().map(|&d| Some(d)).collect();
    let (out_dtype, out_shape) = chain.output(dtype, &known).unwrap();
    let bytes = out_shape.iter().map(|d| d.unwrap()).product::<u64>() as usize * out_dtype.size();
    let mut dst = vec![0xEEu8; bytes];
    chain.apply(ArrayRef { bytes: input, dtype, shape }, key, leader, &mut Scratch::new(), &mut dst).unwrap();
    dst
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_ne_bytes(b.try_into().unwrap())).collect()
}

fn chain(steps: Vec<Step>) -> Chain {
    Chain::new("x", steps, None).unwrap()
}

#[test]
fn center_crop_by_hand() {
    // 5 × 6 gray, value 10y + x; crop 3 × 4 sits at top (5-3)/2 = 1, left (6-4)/2 = 1.
    let input = image(5, 6, 1, |y, x, _| (10 * y + x) as u8);
    let out = run(&chain(vec![Step::CenterCrop { height: 3, width: 4 }]), &input, DType::U8, &[5, 6], KEY);
    assert_eq!(out, vec![11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34]);
    // Odd leftovers round down: 4 × 4 from 5 × 6 → top 0, left 1.
    let out = run(&chain(vec![Step::CenterCrop { height: 4, width: 4 }]), &input, DType::U8, &[5, 6], KEY);
    assert_eq!(&out[..4], &[1, 2, 3, 4]);
}

#[test]
fn random_crop_is_keyed_and_covers_every_offset() {
    let input = image(6, 6, 2, |y, x, ch| (10 * y + x + 100 * ch) as u8);
    let c = chain(vec![Step::RandomCrop { height: 4, width: 4 }]);
    let mut seen = std::collections::HashSet::new();
    for index in 0..400 {
        let out = run(&c, &input, DType::U8, &[6, 6, 2], key(index));
        assert_eq!(out, run(&c, &input, DType::U8, &[6, 6, 2], key(index)), "same key, same crop");
        let (top, left) = (out[0] as usize / 10, out[0] as usize % 10);
        assert!(top <= 2 && left <= 2);
        assert_eq!(out, image(4, 4, 2, |y, x, ch| (10 * (y + top) + x + left + 100 * ch) as u8));
        seen.insert((top, left));
    }
    assert_eq!(seen.len(), 9, "every one of the 3 × 3 offsets is drawn");
    // Another seed or epoch draws differently for some index.
    let other = SampleKey { epoch: 4, ..KEY };
    assert!((0..20).any(|i| run(&c, &input, DType::U8, &[6, 6, 2], key(i))
        != run(&c, &input, DType::U8, &[6, 6, 2], SampleKey { index: i, ..other })));
}

#[test]
fn flip_is_a_fair_keyed_coin_and_mirrors() {
    let input = image(2, 3, 2, |y, x, ch| (10 * y + x + 100 * ch) as u8);
    let mirrored = image(2, 3, 2, |y, x, ch| (10 * y + (2 - x) + 100 * ch) as u8);
    let c = chain(vec![Step::RandomHFlip]);
    let flips = (0..2000)
        .filter(|&i| {
            let out = run(&c, &input, DType::U8, &[2, 3, 2], key(i));
            assert!(out == input || out == mirrored);
            out == mirrored
        })
        .count();
    assert!((900..1100).contains(&flips), "{flips} flips in 2000");
}

#[test]
fn crop_after_flip_crops_the_flipped_image() {
    let input = image(5, 6, 1, |y, x, _| (10 * y + x) as u8);
    let c = chain(vec![Step::RandomHFlip, Step::CenterCrop { height: 3, width: 3 }]);
    let plain = image(3, 3, 1, |y, x, _| (10 * (y + 1) + x + 1) as u8);
    // Flipped: column x of the flipped image is 5 - x of the input; crop columns 1..4.
    let flipped = image(3, 3, 1, |y, x, _| (10 * (y + 1) + (5 - (x + 1))) as u8);
    let outs: Vec<Vec<u8>> = (0..16).map(|i| run(&c, &input, DType::U8, &[5, 6], key(i))).collect();
    assert!(outs.iter().all(|o| *o == plain || *o == flipped));
    assert!(outs.contains(&plain) && outs.contains(&flipped));
}

#[test]
fn normalize_and_chw_by_hand() {
    // 1 × 2 × 3 uint8: pixel 0 = (0, 51, 255), pixel 1 = (255, 102, 0).
    let input = vec![0u8, 51, 255, 255, 102, 0];
    let c = chain(vec![
        Step::ToF32 { scale: 1.0 / 255.0 },
        Step::Normalize { mean: vec![0.5, 0.2, 0.0], std: vec![0.5, 0.1, 2.0] },
        Step::ToChw,
    ]);
    let (dtype, shape) = c.output(DType::U8, &[Some(1), Some(2), Some(3)]).unwrap();
    assert_eq!((dtype, shape), (DType::F32, vec![Some(3), Some(1), Some(2)]));
    let out = f32s(&run(&c, &input, DType::U8, &[1, 2, 3], KEY));
    // Channel-major: R = ((0, 1) - 0.5) / 0.5; G = ((0.2, 0.4) - 0.2) / 0.1; B = ((1, 0) - 0) / 2.
    let want = [-1.0, 1.0, 0.0, 2.0, 0.5, 0.0];
    for (got, want) in out.iter().zip(want) {
        assert!((got - want).abs() < 1e-5, "{out:?} vs {want:?}");
    }
    // A gray [h, w] array becomes [1, h, w]; one mean/std broadcasts.
    let c = chain(vec![Step::Normalize { mean: vec![10.0], std: vec![2.0] }, Step::ToChw]);
    let (dtype, shape) = c.output(DType::U16, &[Some(1), Some(2)]).unwrap();
    assert_eq!((dtype, shape), (DType::F32, vec![Some(1), Some(1), Some(2)]));
    let input: Vec<u8> = [4u16, 30].iter().flat_map(|v| v.to_ne_bytes()).collect();
    assert_eq!(f32s(&run(&c, &input, DType::U16, &[1, 2], KEY)), vec![-3.0, 10.0]);
}

#[test]
fn chw_without_cast_keeps_the_dtype() {
    let input = image(2, 2, 3, |y, x, ch| (100 * ch + 10 * y + x) as u8);
    let out = run(&chain(vec![Step::ToChw]), &input, DType::U8, &[2, 2, 3], KEY);
    assert_eq!(out, vec![0, 1, 10, 11, 100, 101, 110, 111, 200, 201, 210, 211]);
}

#[test]
fn casts_every_dtype() {
    let c = chain(vec![Step::ToF32 { scale: 1.0 }]);
    let cases: Vec<(DType, Vec<u8>, f32)> = vec![
        (DType::Bool, vec![1], 1.0),
        (DType::I8, (-5i8).to_ne_bytes().to_vec(), -5.0),
        (DType::I16, (-300i16).to_ne_bytes().to_vec(), -300.0),
        (DType::U32, 70_000u32.to_ne_bytes().to_vec(), 70_000.0),
        (DType::I64, (-9i64).to_ne_bytes().to_vec(), -9.0),
        (DType::F16, 0xC100u16.to_ne_bytes().to_vec(), -2.5),
        (DType::F64, 0.25f64.to_ne_bytes().to_vec(), 0.25),
    ];
    for (dtype, bytes, want) in cases {
        assert_eq!(f32s(&run(&c, &bytes, dtype, &[1, 1], KEY)), vec![want], "{dtype}");
    }
}

#[test]
fn half_floats_convert_exactly() {
    assert_eq!(f16_to_f32(0x3C00), 1.0);
    assert_eq!(f16_to_f32(0xC000), -2.0);
    assert_eq!(f16_to_f32(0x7BFF), 65504.0);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    assert_eq!(f16_to_f32(0x7C00), f32::INFINITY);
    assert!(f16_to_f32(0x7E00).is_nan());
}

/// HR = LR with every pixel blown up into a 4 × 4 block, so a correctly
/// paired HR crop is exactly the blown-up LR crop.
fn blow_up(lr: &[u8], h: usize, w: usize, c: usize, s: usize) -> Vec<u8> {
    image(h * s, w * s, c, |y, x, ch| lr[((y / s) * w + x / s) * c + ch])
}

#[test]
fn paired_crops_and_flips_line_up_exactly() {
    let (h, w, c, s) = (9, 11, 3, 4);
    let lr = image(h, w, c, |y, x, ch| (y * 23 + x * 7 + ch * 80) as u8);
    let hr = blow_up(&lr, h, w, c, s);
    let lr_chain = Chain::new("lr", vec![Step::RandomCrop { height: 4, width: 5 }, Step::RandomHFlip], None).unwrap();
    let hr_chain = Chain::new(
        "hr",
        vec![Step::RandomCrop { height: 16, width: 20 }, Step::RandomHFlip],
        Some(Pair { with: "lr".into(), scale: 4 }),
    )
    .unwrap();
    hr_chain.check_pair(&lr_chain).unwrap();
    let mut offsets = std::collections::HashSet::new();
    for index in 0..200 {
        let lr_out = run(&lr_chain, &lr, DType::U8, &[9, 11, 3], key(index));
        let hr_out = run_paired(&hr_chain, &hr, DType::U8, &[36, 44, 3], key(index), Some(&[9, 11, 3]));
        assert_eq!(hr_out, blow_up(&lr_out, 4, 5, 3, 4), "index {index}");
        offsets.insert(lr_out[..3].to_vec());
    }
    assert!(offsets.len() > 20, "crops vary: {} distinct", offsets.len());
    // An unpaired chain with the same steps on another field draws on its own.
    let solo = Chain::new("other", vec![Step::RandomCrop { height: 4, width: 5 }, Step::RandomHFlip], None).unwrap();
    assert!((0..20).any(
        |i| run(&solo, &lr, DType::U8, &[9, 11, 3], key(i)) != run(&lr_chain, &lr, DType::U8, &[9, 11, 3], key(i))
    ));
}

#[test]
fn paired_center_crop_then_resize() {
    // Odd leftovers: the leader rounds its offset, the follower scales the rounded offset.
    let (h, w, c, s) = (7, 8, 1, 2);
    let lr = image(h, w, c, |y, x, _| (y * 16 + x) as u8);
    let hr = blow_up(&lr, h, w, c, s);
    let lr_chain = Chain::new("lr", vec![Step::CenterCrop { height: 4, width: 4 }], None).unwrap();
    let hr_chain =
        Chain::new("hr", vec![Step::CenterCrop { height: 8, width: 8 }], Some(Pair { with: "lr".into(), scale: 2 }))
            .unwrap();
    hr_chain.check_pair(&lr_chain).unwrap();
    let lr_out = run(&lr_chain, &lr, DType::U8, &[7, 8, 1], KEY);
    let hr_out = run_paired(&hr_chain, &hr, DType::U8, &[14, 16, 1], KEY, Some(&[7, 8, 1]));
    assert_eq!(hr_out, blow_up(&lr_out, 4, 4, 1, 2));
}

#[test]
fn pairing_is_checked() {
    let lr = Chain::new("lr", vec![Step::RandomCrop { height: 4, width: 4 }], None).unwrap();
    let pair = || Some(Pair { with: "lr".into(), scale: 4 });
    let wrong_size = Chain::new("hr", vec![Step::RandomCrop { height: 15, width: 16 }], pair()).unwrap();
    assert!(wrong_size.check_pair(&lr).is_err());
    let extra_flip =
        Chain::new("hr", vec![Step::RandomCrop { height: 16, width: 16 }, Step::RandomHFlip], pair()).unwrap();
    assert!(extra_flip.check_pair(&lr).is_err());
    let good = Chain::new("hr", vec![Step::RandomCrop { height: 16, width: 16 }, Step::ToChw], pair()).unwrap();
    good.check_pair(&lr).unwrap();
    // At read time the follower's input must be scale × the leader's.
    let hr = vec![0u8; 30 * 32];
    let mut dst = vec![0u8; 16 * 16];
    let err = good
        .apply(
            ArrayRef { bytes: &hr, dtype: DType::U8, shape: &[30, 32] },
            KEY,
            Some(&[8, 8]),
            &mut Scratch::new(),
            &mut dst,
        )
        .unwrap_err();
    assert!(err.to_string().contains("at scale 4 they must be 32×32"), "{err}");
    let chained = Chain::new("x", vec![], Some(Pair { with: "hr".into(), scale: 1 })).unwrap();
    assert!(chained.check_pair(&good).is_err(), "no chains of followers");
    assert!(Chain::new("lr", vec![], Some(Pair { with: "lr".into(), scale: 2 })).is_err());
    assert!(Chain::new("hr", vec![], Some(Pair { with: "lr".into(), scale: 0 })).is_err());
    // A hostile scale whose products with a leader's size would wrap (2^63 + 1 times 2 is 2 mod 2^64).
    let huge = Chain::new("hr", vec![], Some(Pair { with: "lr".into(), scale: (1 << 63) + 1 })).unwrap_err();
    assert!(huge.to_string().contains("outside 1..=64"), "{huge}");
    assert!(Chain::new("hr", vec![], Some(Pair { with: "lr".into(), scale: MAX_PAIR_SCALE })).is_ok());
}

#[test]
fn declared_output_shapes() {
    let c = chain(vec![Step::RandomCrop { height: 96, width: 64 }, Step::ToF32 { scale: 1.0 }, Step::ToChw]);
    assert_eq!(c.output(DType::U8, &[None, None, Some(3)]).unwrap(), (DType::F32, vec![Some(3), Some(96), Some(64)]));
    assert_eq!(c.output(DType::U8, &[None, None, None]).unwrap().1, vec![None, Some(96), Some(64)]);
    assert!(c.output(DType::U8, &[Some(50), Some(200), Some(3)]).is_err(), "too small to crop");
    assert!(c.output(DType::U8, &[Some(5)]).is_err(), "rank 1");
    let r = chain(vec![Step::Resize { height: 8, width: 8, filter: Filter::Bilinear }]);
    assert!(r.output(DType::I16, &[Some(9), Some(9)]).is_err());
    assert!(r.output(DType::U8, &[Some(9), Some(9), Some(5)]).is_err());
    assert_eq!(r.output(DType::U16, &[None, None, Some(4)]).unwrap(), (DType::U16, vec![Some(8), Some(8), Some(4)]));
    let n = chain(vec![Step::Normalize { mean: vec![0.0, 0.0], std: vec![1.0, 1.0] }]);
    assert!(n.output(DType::U8, &[Some(2), Some(2), Some(3)]).is_err());
}

#[test]
fn malformed_chains_are_rejected() {
    for steps in [
        vec![Step::ToChw, Step::RandomHFlip],
        vec![Step::ToChw, Step::ToChw],
        vec![Step::CenterCrop { height: 0, width: 3 }],
        vec![Step::Normalize { mean: vec![0.0, 1.0], std: vec![1.0] }],
        vec![Step::Normalize { mean: vec![0.0], std: vec![0.0] }],
    ] {
        assert!(Chain::new("x", steps.clone(), None).is_err(), "{steps:?}");
    }
}

#[test]
fn bilinear_resize_matches_pillow() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/codec/testdata");
    let input = std::fs::read(dir.join("png/rgb8.png.expect")).unwrap(); // 19 × 27 × 3
    let want = std::fs::read(dir.join("resize/rgb8_to_11x16.expect")).unwrap();
    let c = chain(vec![Step::Resize { height: 11, width: 16, filter: Filter::Bilinear }]);
    let out = run(&c, &input, DType::U8, &[19, 27, 3], KEY);
    let max = out.iter().zip(&want).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
    eprintln!("bilinear resize: max abs diff {max} from Pillow");
    assert!(max <= 1, "max abs diff {max} from Pillow's bilinear resize");
}

#[test]
fn resize_after_crop_flip_and_cast() {
    let input = image(12, 10, 3, |y, x, ch| (y * 20 + x * 3 + ch) as u8);
    // Resize to the same size is the identity, so each path is checkable by hand.
    let same = |h, w| Step::Resize { height: h, width: w, filter: Filter::Bilinear };
    let cropped =
        run(&chain(vec![Step::CenterCrop { height: 6, width: 4 }, same(6, 4)]), &input, DType::U8, &[12, 10, 3], KEY);
    assert_eq!(
        cropped,
        run(&chain(vec![Step::CenterCrop { height: 6, width: 4 }]), &input, DType::U8, &[12, 10, 3], KEY)
    );
    let flip_first = chain(vec![Step::RandomHFlip, same(12, 10)]);
    let flip_only = chain(vec![Step::RandomHFlip]);
    for i in 0..4 {
        assert_eq!(
            run(&flip_first, &input, DType::U8, &[12, 10, 3], key(i)),
            run(&flip_only, &input, DType::U8, &[12, 10, 3], key(i))
        );
    }
    let cast_first = chain(vec![Step::ToF32 { scale: 0.5 }, same(12, 10)]);
    let out = f32s(&run(&cast_first, &input, DType::U8, &[12, 10, 3], KEY));
    for (o, i) in out.iter().zip(&input) {
        assert!((o - f32::from(*i) * 0.5).abs() < 1e-4);
    }
    // Shrinking a constant image keeps it constant, in every filter.
    let flat = vec![77u8; 12 * 10 * 3];
    for filter in [Filter::Nearest, Filter::Bilinear, Filter::Bicubic, Filter::Lanczos3] {
        let out = run(&chain(vec![Step::Resize { height: 5, width: 3, filter }]), &flat, DType::U8, &[12, 10, 3], KEY);
        assert!(out.iter().all(|&v| v == 77), "{filter:?}");
    }
}

#[test]
fn destination_and_input_sizes_are_checked() {
    let c = chain(vec![Step::CenterCrop { height: 2, width: 2 }]);
    let input = vec![0u8; 16];
    let mut small = vec![0u8; 3];
    assert!(
        c.apply(
            ArrayRef { bytes: &input, dtype: DType::U8, shape: &[4, 4] },
            KEY,
            None,
            &mut Scratch::new(),
            &mut small
        )
        .is_err()
    );
    let mut dst = vec![0u8; 4];
    assert!(
        c.apply(
            ArrayRef { bytes: &input[..15], dtype: DType::U8, shape: &[4, 4] },
            KEY,
            None,
            &mut Scratch::new(),
            &mut dst
        )
        .is_err()
    );
}

fn u8s_run(steps: Vec<Step>, input: &[u8], shape: &[u64], key: SampleKey) -> Vec<u8> {
    run(&chain(steps), input, DType::U8, shape, key)
}

#[test]
fn vflip_is_a_keyed_coin_and_mirrors_rows() {
    // 3 × 2 gray, value 10y + x.
    let input = image(3, 2, 1, |y, x, _| (10 * y + x) as u8);
    let mirrored = vec![20, 21, 10, 11, 0, 1];
    let mut flips = 0;
    for i in 0..64 {
        let out = u8s_run(vec![Step::RandomVFlip], &input, &[3, 2], key(i));
        assert!(out == input || out == mirrored, "{out:?}");
        flips += usize::from(out == mirrored);
        assert_eq!(out, u8s_run(vec![Step::RandomVFlip], &input, &[3, 2], key(i)), "keyed");
    }
    assert!((16..=48).contains(&flips), "{flips} flips in 64");
}

#[test]
fn rot90_takes_every_quarter_turn_like_numpy() {
    // [[1, 2], [3, 4]]: np.rot90 k = 0..3.
    let input = [1u8, 2, 3, 4];
    let turns = [vec![1u8, 2, 3, 4], vec![2, 4, 1, 3], vec![4, 3, 2, 1], vec![3, 1, 4, 2]];
    let mut seen = [0; 4];
    for i in 0..64 {
        let out = u8s_run(vec![Step::RandomRot90], &input, &[2, 2], key(i));
        let k = turns.iter().position(|t| *t == out).unwrap_or_else(|| panic!("{out:?} is no rotation"));
        seen[k] += 1;
    }
    assert!(seen.iter().all(|&n| n > 0), "{seen:?}");
    let c = chain(vec![Step::RandomRot90]);
    assert!(c.output(DType::U8, &[Some(2), Some(3)]).is_err(), "rot90 of a non-square array");
}

#[test]
fn cast_follows_numpy_astype() {
    let c = chain(vec![Step::Cast { dtype: DType::U8 }]);
    let i16s: Vec<u8> = [-1i16, 300, 7, 255].iter().flat_map(|v| v.to_ne_bytes()).collect();
    assert_eq!(run(&c, &i16s, DType::I16, &[2, 2], KEY), vec![255, 44, 7, 255], "integers wrap");
    let f32s_in: Vec<u8> = [1.9f32, -0.5, 300.0, 2.0].iter().flat_map(|v| v.to_ne_bytes()).collect();
    assert_eq!(run(&c, &f32s_in, DType::F32, &[2, 2], KEY), vec![1, 0, 255, 2], "floats truncate, saturate");
    let to_f64 = chain(vec![Step::Cast { dtype: DType::F64 }]);
    let out = run(&to_f64, &[1, 2, 3, 250], DType::U8, &[2, 2], KEY);
    let f64s: Vec<f64> = out.chunks_exact(8).map(|b| f64::from_ne_bytes(b.try_into().unwrap())).collect();
    assert_eq!(f64s, [1.0, 2.0, 3.0, 250.0]);
    // float16 rounds to nearest even, overflows to infinity, as numpy's astype.
    let to_f16 = chain(vec![Step::Cast { dtype: DType::F16 }]);
    let f64s_in: Vec<u8> =
        [1.0f64 / 3.0, 65519.0, 65520.0, -1e-8, 2049.0, 2051.0].iter().flat_map(|v| v.to_ne_bytes()).collect();
    let out = run(&to_f16, &f64s_in, DType::F64, &[2, 3], KEY);
    let bits: Vec<u16> = out.chunks_exact(2).map(|b| u16::from_ne_bytes(b.try_into().unwrap())).collect();
    assert_eq!(bits, [0x3555, 0x7BFF, 0x7C00, 0x8000, 0x6800, 0x6802]);
    let u8s = run(&to_f16, &[0, 1, 255, 128], DType::U8, &[2, 2], KEY);
    let bits: Vec<u16> = u8s.chunks_exact(2).map(|b| u16::from_ne_bytes(b.try_into().unwrap())).collect();
    assert_eq!(bits, [0x0000, 0x3C00, 0x5BF8, 0x5800]);
}

#[test]
fn permute_and_chw_on_more_dimensions() {
    // [2, 3, 4] with value 100a + 10b + c; permute [2, 0, 1] gives out[c, a, b].
    let input: Vec<u8> =
        (0..2).flat_map(|a| (0..3).flat_map(move |b| (0..4).map(move |c| 100 * a + 10 * b + c))).collect();
    let out = u8s_run(vec![Step::Permute { axes: vec![2, 0, 1] }], &input, &[2, 3, 4], KEY);
    let want: Vec<u8> =
        (0..4).flat_map(|c| (0..2).flat_map(move |a| (0..3).map(move |b| 100 * a + 10 * b + c))).collect();
    assert_eq!(out, want);
    // [t, h, w, c] → chw moves c before the spatial axes: [t, c, h, w].
    let c = chain(vec![Step::Cast { dtype: DType::U8 }, Step::ToChw]);
    assert_eq!(
        c.output(DType::U8, &[Some(2), Some(3), Some(4), Some(5)]).unwrap().1,
        vec![Some(2), Some(5), Some(3), Some(4)]
    );
    assert!(Chain::new("x", vec![Step::Permute { axes: vec![0, 0] }], None).is_err());
    assert!(chain(vec![Step::Permute { axes: vec![1, 0] }]).output(DType::U8, &[Some(2), Some(2), Some(2)]).is_err());
}

#[test]
fn downsample_by_mean_and_by_stride() {
    // 4 × 5, value 10y + x; factor 2 keeps 2 × 2 blocks (the last column dropped).
    let input = image(4, 5, 1, |y, x, _| (10 * y + x) as u8);
    let strided = u8s_run(vec![Step::Downsample { factor: 2, mean: false }], &input, &[4, 5], KEY);
    assert_eq!(strided, vec![0, 2, 20, 22]);
    let c = chain(vec![Step::Downsample { factor: 2, mean: true }]);
    assert_eq!(c.output(DType::U8, &[Some(4), Some(5)]).unwrap(), (DType::F32, vec![Some(2), Some(2)]));
    let means = f32s(&run(&c, &input, DType::U8, &[4, 5], KEY));
    assert_eq!(means, vec![5.5, 7.5, 25.5, 27.5]);
    assert!(c.output(DType::U8, &[Some(1), Some(5)]).is_err(), "nothing left");
}

#[test]
fn normalize_broadcasts_over_trailing_axes() {
    // [2, 2, 2, 2] ones; statistics of shape [2, 2] over the last two axes.
    let c = chain(vec![Step::NormalizeTrailing {
        mean: vec![0.0, 1.0, 2.0, 3.0],
        std: vec![1.0, 2.0, 4.0, 8.0],
        dims: vec![2, 2],
    }])
    .with_spatial_axes(Some([0, 1]));
    let out = f32s(&run(&c, &[1u8; 16], DType::U8, &[2, 2, 2, 2], KEY));
    for px in out.chunks_exact(4) {
        assert_eq!(px, [1.0, 0.0, -0.25, -0.25]);
    }
    assert!(c.output(DType::U8, &[Some(2), Some(2), Some(3)]).is_err());
}

#[test]
fn spatial_axes_choose_what_crops_and_flips_move() {
    // [3, 4, 4] with spatial axes 1, 2: a centre crop 2 × 2 of each of the 3 planes.
    let input: Vec<u8> = (0..48).collect();
    let c = chain(vec![Step::CenterCrop { height: 2, width: 2 }]).with_spatial_axes(Some([-2, -1]));
    let out = run(&c, &input, DType::U8, &[3, 4, 4], KEY);
    assert_eq!(out, vec![5, 6, 9, 10, 21, 22, 25, 26, 37, 38, 41, 42]);
    let bad = chain(vec![Step::RandomHFlip]).with_spatial_axes(Some([0, 5]));
    assert!(bad.output(DType::U8, &[Some(3), Some(4)]).is_err());
}

#[test]
fn paired_nd_chains_rotate_and_crop_together() {
    let lr = image(4, 4, 1, |y, x, _| (10 * y + x) as u8);
    let hr = blow_up(&lr, 4, 4, 1, 2);
    let steps = |s: u64| vec![Step::RandomCrop { height: 2 * s, width: 2 * s }, Step::RandomVFlip, Step::RandomRot90];
    let lr_chain = chain(steps(1));
    let hr_chain = Chain::new("hr", steps(2), Some(Pair { with: "x".into(), scale: 2 })).unwrap();
    hr_chain.check_pair(&lr_chain).unwrap();
    for i in 0..32 {
        let a = run(&lr_chain, &lr, DType::U8, &[4, 4], key(i));
        let b = run_paired(&hr_chain, &hr, DType::U8, &[8, 8], key(i), Some(&[4, 4]));
        assert_eq!(b, blow_up(&a, 2, 2, 1, 2), "sample {i}");
    }
}

/// The element-at-a-time writer the row paths of `write_out` replaced: every
/// element through `reader` and `mul_add`, indexed by `View::at`.
fn write_out_by_element(src: &[u8], view: &View, affine: &Affine, chw: bool, dst: &mut [u8]) {
    let (h, w, c) = (view.h as usize, view.w as usize, view.c as usize);
    let size = view.dtype.size();
    let dst_index = |y: usize, x: usize, ch: usize| if chw { (ch * h + y) * w + x } else { (y * w + x) * c + ch };
    let read = reader(view.dtype);
    for y in 0..h {
        for x in 0..w {
            let at = view.at(y as u64, x as u64) as usize;
            for ch in 0..c {
                let from = (at + ch) * size;
                match &affine.coefficients {
                    None => {
                        let to = dst_index(y, x, ch) * size;
                        dst[to..to + size].copy_from_slice(&src[from..from + size]);
                    }
                    Some(coefficients) => {
                        let (mul, add) = coefficients[ch];
                        let value = affine.finish(ch, read(&src[from..from + size]).mul_add(mul as f32, add as f32));
                        let to = dst_index(y, x, ch) * 4;
                        dst[to..to + 4].copy_from_slice(&value.to_ne_bytes());
                    }
                }
            }
        }
    }
}

#[test]
fn row_writer_equals_the_element_writer_for_every_dtype_flip_crop_and_layout() {
    let (h, w) = (7u64, 9u64);
    for dtype in [DType::U8, DType::U16, DType::I16, DType::F32, DType::F64, DType::F16] {
        for c in [1u64, 3, 4] {
            let n = (h * w * c) as usize * dtype.size();
            // Every byte pattern, NaN and infinities included for the float types.
            let src: Vec<u8> = (0..n).map(|i| (i as u64).wrapping_mul(0x9E37_79B9).rotate_left(7) as u8).collect();
            for flipped in [false, true] {
                let mut view = View { backing: Backing::Input, offset: 0, h, w, c, stride: w * c, flipped, dtype };
                view.crop(1, 2, 5, 6).unwrap();
                let mut normalized = Affine::identity(c as usize);
                normalized.then_scale(1.0 / 255.0);
                normalized.then_normalize(
                    &[0.485, 0.456, 0.406, 0.5][..c as usize],
                    &[0.229, 0.224, 0.225, 0.25][..c as usize],
                );
                for affine in [Affine::identity(c as usize), normalized] {
                    for chw in [false, true] {
                        let out_size = if affine.is_identity() { dtype.size() } else { 4 };
                        let bytes = (view.h * view.w * c) as usize * out_size;
                        let (mut got, mut want) = (vec![0xAAu8; bytes], vec![0x55u8; bytes]);
                        write_out(&src, &view, &affine, chw, &mut got);
                        write_out_by_element(&src, &view, &affine, chw, &mut want);
                        assert_eq!(got, want, "{dtype} c={c} flipped={flipped} chw={chw} affine={affine:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn fewer_than_two_dimensions_take_element_steps_only() {
    // A scalar label cast, a feature vector normalized per element and permuted.
    let cast = chain(vec![Step::Cast { dtype: DType::I16 }]);
    assert_eq!(cast.output(DType::I64, &[]).unwrap(), (DType::I16, vec![]));
    let label: Vec<u8> = 70_000i64.to_ne_bytes().to_vec();
    assert_eq!(run(&cast, &label, DType::I64, &[], KEY), (70_000i64 as i16).to_ne_bytes().to_vec());
    let norm = chain(vec![
        Step::Normalize { mean: vec![1.0, 2.0, 3.0], std: vec![1.0, 2.0, 4.0] },
        Step::Permute { axes: vec![0] },
    ]);
    let feat: Vec<u8> = [3.0f32, 6.0, 11.0].iter().flat_map(|v| v.to_ne_bytes()).collect();
    let out = run(&norm, &feat, DType::F32, &[3], KEY);
    let got: Vec<f32> = out.chunks_exact(4).map(|b| f32::from_ne_bytes(b.try_into().unwrap())).collect();
    assert_eq!(got, [2.0, 2.0, 2.0]);
    // Geometry needs two spatial axes: refused, naming what a 1-d field takes.
    for step in [Step::RandomHFlip, Step::ToChw, Step::Downsample { factor: 2, mean: true }] {
        let err = chain(vec![step]).output(DType::F32, &[Some(4)]).unwrap_err().to_string();
        assert!(err.contains("takes only cast, normalize and permute"), "{err}");
    }
}

/// One step drawn from small parameters (sizes and axes often out of range).
fn any_step(kind: u8, a: u64, b: u64, axes: &[usize]) -> Step {
    const DTYPES: [DType; 6] = [DType::U8, DType::U16, DType::I64, DType::F16, DType::F32, DType::F64];
    match kind % 12 {
        0 => Step::CenterCrop { height: a, width: b },
        1 => Step::RandomCrop { height: a, width: b },
        2 => Step::RandomHFlip,
        3 => Step::RandomVFlip,
        4 => Step::RandomRot90,
        5 => Step::Cast { dtype: DTYPES[a as usize % DTYPES.len()] },
        6 => Step::Normalize { mean: vec![0.5; 1 + a as usize % 4], std: vec![2.0; 1 + a as usize % 4] },
        7 => Step::NormalizeTrailing {
            mean: vec![0.5; (a * b) as usize],
            std: vec![2.0; (a * b) as usize],
            dims: vec![a, b],
        },
        8 => Step::Permute { axes: axes.to_vec() },
        9 => Step::Downsample { factor: a, mean: b.is_multiple_of(2) },
        10 => Step::ToChw,
        _ => Step::ToF32 { scale: 0.5 },
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4096))]
    /// The class behind a 0-d field reaching an index panic with per-channel
    /// means: whatever steps, shape and dtype a user sends, a chain that
    /// validates either refuses the array or writes exactly its output,
    /// never panics.
    #[test]
    fn any_chain_on_any_array_refuses_or_writes_its_output(
        steps in proptest::collection::vec((0u8..12, 0u64..6, 0u64..6, proptest::collection::vec(0usize..5, 0..5)), 0..5),
        shape in proptest::collection::vec(1u64..6, 0..5),
        dtype in 0usize..4,
        index: u64,
    ) {
        let dtype = [DType::U8, DType::I16, DType::F32, DType::F64][dtype];
        let steps: Vec<Step> = steps.iter().map(|(k, a, b, axes)| any_step(*k, *a, *b, axes)).collect();
        let Ok(chain) = Chain::new("x", steps, None) else { return Ok(()) };
        let known: Vec<Option<u64>> = shape.iter().map(|&d| Some(d)).collect();
        let Ok((out_dtype, out_shape)) = chain.output(dtype, &known) else { return Ok(()) };
        let elems: u64 = shape.iter().product();
        let input: Vec<u8> = (0..elems as usize * dtype.size()).map(|i| (i * 37 % 251) as u8).collect();
        let bytes = out_shape.iter().map(|d| d.unwrap()).product::<u64>() as usize * out_dtype.size();
        let mut dst = vec![0xEEu8; bytes];
        let applied =
            chain.apply(ArrayRef { bytes: &input, dtype, shape: &shape }, key(index), None, &mut Scratch::new(), &mut dst);
        proptest::prop_assert!(applied.is_ok(), "{:?} on {dtype} {shape:?}: {applied:?}", chain.steps());
    }
}

/// `step` with its sizes times `scale` (a paired field's copy of its leader's).
fn scaled(step: &Step, scale: u64) -> Step {
    match step {
        Step::CenterCrop { height, width } => Step::CenterCrop { height: height * scale, width: width * scale },
        Step::RandomCrop { height, width } => Step::RandomCrop { height: height * scale, width: width * scale },
        other => other.clone(),
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]
    /// Paired fields (LR/HR, input/output windows): whatever the two arrays'
    /// shapes, once both chains validate and pair, the follower given the
    /// leader's shape refuses a mismatch or writes its output, never panics.
    #[test]
    fn any_paired_chains_refuse_or_write_their_outputs(
        steps in proptest::collection::vec((0u8..12, 0u64..5, 0u64..5, proptest::collection::vec(0usize..4, 0..4)), 0..4),
        extra in proptest::collection::vec((5u8..12, 0u64..4, 0u64..4, proptest::collection::vec(0usize..4, 0..4)), 0..2),
        lead in proptest::collection::vec(1u64..6, 0..4),
        other in proptest::collection::vec(1u64..13, 0..4),
        matching: bool,
        scale in 1u64..4,
        index: u64,
    ) {
        let steps: Vec<Step> = steps.iter().map(|(k, a, b, axes)| any_step(*k, *a, *b, axes)).collect();
        let mut mine: Vec<Step> = steps.iter().map(|s| scaled(s, scale)).collect();
        mine.extend(extra.iter().map(|(k, a, b, axes)| any_step(*k, *a, *b, axes)));
        let Ok(leader) = Chain::new("lr", steps, None) else { return Ok(()) };
        let pair = Pair { with: "lr".into(), scale };
        let Ok(follower) = Chain::new("hr", mine, Some(pair)) else { return Ok(()) };
        if follower.check_pair(&leader).is_err() {
            return Ok(());
        }
        // Mostly the leader's shape scaled on its two spatial axes, as pairs are.
        let follow: Vec<u64> = if matching {
            lead.iter().enumerate().map(|(i, &d)| if i < 2 { d * scale } else { d }).collect()
        } else {
            other
        };
        let known: Vec<Option<u64>> = follow.iter().map(|&d| Some(d)).collect();
        let Ok((out_dtype, out_shape)) = follower.output(DType::U8, &known) else { return Ok(()) };
        let input: Vec<u8> = (0..follow.iter().product::<u64>()).map(|i| (i * 37 % 251) as u8).collect();
        let bytes = out_shape.iter().map(|d| d.unwrap()).product::<u64>() as usize * out_dtype.size();
        let mut dst = vec![0xEEu8; bytes];
        // Only panics fail: a leader shape that does not fit is an error to report.
        let _ = follower.apply(
            ArrayRef { bytes: &input, dtype: DType::U8, shape: &follow },
            key(index),
            Some(&lead),
            &mut Scratch::new(),
            &mut dst,
        );
    }
}
