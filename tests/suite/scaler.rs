//! `LossScaler`: MMCV's update rule, exactly (REFERENCE.md section 1).

use memsave::scaler::{LossScaler, ScaleMode};

fn dynamic(init: f64) -> LossScaler {
    LossScaler::new(init, ScaleMode::Dynamic, 2.0, 1000).unwrap()
}

#[test]
fn doubles_exactly_at_the_thousandth_clean_update_from_a_fresh_start() {
    let mut scaler = dynamic(512.0);
    for update in 1..1000 {
        scaler.update_scale(false);
        assert_eq!(scaler.loss_scale(), 512.0, "after clean update {update}");
    }
    scaler.update_scale(false);
    assert_eq!(
        scaler.loss_scale(),
        1024.0,
        "the 1000th clean update doubles"
    );
    for _ in 0..999 {
        scaler.update_scale(false);
    }
    assert_eq!(scaler.loss_scale(), 1024.0);
    scaler.update_scale(false);
    assert_eq!(scaler.loss_scale(), 2048.0, "and every 1000 after");
}

#[test]
fn after_an_overflow_at_k_the_next_doubling_is_at_k_plus_1000() {
    let mut scaler = dynamic(512.0);
    let k = 123;
    for _ in 0..k {
        scaler.update_scale(false);
    }
    scaler.update_scale(true); // update number k (counting from 0)
    assert_eq!(scaler.loss_scale(), 256.0, "an overflow halves");
    // Updates k+1 .. k+999 are clean and change nothing; update k+1000 doubles.
    for update in k + 1..k + 1000 {
        scaler.update_scale(false);
        assert_eq!(scaler.loss_scale(), 256.0, "update {update}");
    }
    scaler.update_scale(false);
    assert_eq!(scaler.loss_scale(), 512.0, "update k + 1000 doubles");
}

#[test]
fn a_scale_of_one_stays_one_on_overflow() {
    let mut scaler = dynamic(2.0);
    scaler.update_scale(true);
    assert_eq!(scaler.loss_scale(), 1.0);
    scaler.update_scale(true);
    assert_eq!(scaler.loss_scale(), 1.0);
}

#[test]
fn static_mode_never_changes() {
    let mut scaler = LossScaler::fixed(512.0).unwrap();
    for overflow in [true, false, true].into_iter().cycle().take(3000) {
        scaler.update_scale(overflow);
        assert_eq!(scaler.loss_scale(), 512.0);
    }
    // Not even the count moves: switched to dynamic it would start fresh (state equality).
    assert_eq!(scaler, LossScaler::fixed(512.0).unwrap());
}

#[test]
fn gradscaler_style_backoff() {
    let mut scaler = LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 2000)
        .unwrap()
        .with_backoff_factor(0.25)
        .unwrap();
    scaler.update_scale(true);
    assert_eq!(scaler.loss_scale(), 16384.0);
    assert!(LossScaler::default().with_backoff_factor(1.5).is_err());
}

#[test]
fn state_round_trips_through_serde() {
    let mut scaler = dynamic(512.0);
    for i in 0..1500 {
        scaler.update_scale(i == 700);
    }
    let json = serde_json::to_string(&scaler).unwrap();
    let mut restored: LossScaler = serde_json::from_str(&json).unwrap();
    assert_eq!(restored, scaler);
    // And they go on identically.
    for i in 0..2500 {
        scaler.update_scale(i % 777 == 0);
        restored.update_scale(i % 777 == 0);
        assert_eq!(restored.loss_scale(), scaler.loss_scale());
    }
}

#[test]
fn a_window_above_i64_max_never_grows_the_scale() {
    let mut scaler = LossScaler::new(512.0, ScaleMode::Dynamic, 2.0, u64::MAX).unwrap();
    for _ in 0..5000 {
        scaler.update_scale(false);
    }
    assert_eq!(scaler.loss_scale(), 512.0);
    scaler.update_scale(true);
    for _ in 0..5000 {
        scaler.update_scale(false);
    }
    assert_eq!(scaler.loss_scale(), 256.0);
}

#[test]
fn growth_never_reaches_a_non_finite_scale() {
    let mut scaler = LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 1).unwrap();
    for _ in 0..5000 {
        scaler.update_scale(false);
        assert!(scaler.loss_scale().is_finite(), "{}", scaler.loss_scale());
    }
    // It stopped at the largest finite power of two, and an overflow still halves it.
    assert_eq!(scaler.loss_scale(), 2f64.powi(1023));
    scaler.update_scale(true);
    assert_eq!(scaler.loss_scale(), 2f64.powi(1022));
}

#[test]
fn a_stored_state_is_checked_when_it_is_read_back() {
    let good = serde_json::to_value(LossScaler::default()).unwrap();
    let with = |field: &str, value: serde_json::Value| {
        let mut state = good.clone();
        state[field] = value;
        serde_json::from_value::<LossScaler>(state)
            .unwrap_err()
            .to_string()
    };
    let message = with("scale_window", 0.into());
    assert!(message.contains("scale_window"), "{message}");
    let message = with("scale_factor", 0.5.into());
    assert!(message.contains("scale_factor"), "{message}");
    let message = with("cur_scale", (-2.0).into());
    assert!(message.contains("init_scale"), "{message}");
    let message = with("last_overflow_iter", 5.into());
    assert!(message.contains("last_overflow_iter"), "{message}");
    let message = with("backoff_factor", 3.0.into());
    assert!(message.contains("backoff_factor"), "{message}");
    // A static state may keep a window of 0: it never grows.
    let mut state = serde_json::to_value(LossScaler::fixed(512.0).unwrap()).unwrap();
    state["scale_window"] = 0.into();
    assert!(serde_json::from_value::<LossScaler>(state).is_ok());
}
